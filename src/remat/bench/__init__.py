"""Benchmarks: remat against its peers and the papers, measured in one process, as ratios.

``remat bench SUITE`` (see ``remat.cli.bench``) runs :func:`remat.bench.suites.run_suite`.
"""
