"""Package discovery for the `harts` namespace (metadata lives in pyproject.toml).

The design card keeps `compiler/`, `executor/`, `schema/` and `tools/` at the
top level; they install as `harts.compiler`, `harts.executor`, ... . setuptools
cannot discover subpackages through a `package-dir` mapping by itself, so this
file lists them.
"""
from setuptools import find_packages, setup

MAPPED_ROOTS = ("compiler", "executor", "schema", "tools")

packages = ["harts"]
for root in MAPPED_ROOTS:
    packages += [f"harts.{name}" for name in find_packages(include=[root, f"{root}.*"])]

setup(packages=packages)
