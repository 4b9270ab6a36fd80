"""The one packaging rule pyproject.toml cannot state: the repository's top-level folders install
under a single import name, ``inferflux.<folder>`` (gateway/ is ``inferflux.gateway``, and so on),
so the distribution puts no generic top-level module (``gateway``, ``kernels``, ...) into the
environments it enters. Everything else about the distribution is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

FOLDERS = ("gateway", "policy", "backends", "kernels")

# find_namespace_packages, not find_packages: policy/store/migrations/ (Alembic's scripts) and the
# console's static/ and templates/ hold no __init__.py, and are packages only in that sense; their
# data files are listed in pyproject.toml's package-data.
found = find_namespace_packages(include=[pattern for f in FOLDERS for pattern in (f, f"{f}.*")],
                                exclude=["*.__pycache__"])
setup(
    packages=[f"inferflux.{name}" for name in found],
    package_dir={f"inferflux.{folder}": folder for folder in FOLDERS},
)
