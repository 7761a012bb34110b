"""Which submodule the stages run was replaced in the model after the split."""

from __future__ import annotations

from torch import nn

from remat.capture.stages.base import Stages


class StageWatch:
    """Tells when a submodule the stages run was replaced in the model after the split.

    Stage modules are the model's own submodules (or the splitter's wrappers and groups that
    hold them): ``model.fc = nn.Linear(...)`` afterwards leaves the stages running the old
    ``fc``. The watch records the model's submodules the stages hold and, for every module on
    their paths from the model, its children; :meth:`changed` compares those with the model's
    current children (a few identity checks). A change deeper inside a stage module
    (``model.layer1[0].conv1 = ...``) needs no watching: the stage module runs its new child.
    """

    def __init__(self, model: nn.Module, stages: Stages) -> None:
        paths: dict[int, list[str]] = {}
        by_name: dict[str, nn.Module] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(name)
            by_name[name] = module
        held: set[str] = set()

        def visit(module: nn.Module) -> None:
            if id(module) in paths:
                held.update(paths[id(module)])
            else:  # a wrapper or group made by the splitter: what it holds
                for child in module.children():
                    visit(child)

        for module in stages.modules:
            visit(module)
        parents = {".".join(p.split(".")[:k]) for p in held if p for k in range(p.count(".") + 1)}
        self._parents = [
            (prefix, by_name[prefix], tuple(by_name[prefix]._modules.items()))
            for prefix in sorted(parents)
        ]

    def changed(self) -> str | None:
        """None while the model holds the same submodules; else which one changed."""
        for prefix, parent, children in self._parents:
            now = parent._modules
            here = prefix + "." if prefix else ""
            for name, child in children:
                if now.get(name) is not child:
                    return f"{here + name!r} ({'replaced' if name in now else 'removed'})"
            if len(now) != len(children):
                added = [k for k in now if k not in dict(children)]
                return f"{here + (added[0] if added else '?')!r} (added)"
        return None
