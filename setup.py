"""Package discovery (the rest of the metadata is in pyproject.toml): rlpipe/ and its subpackages,
and components/ and pipelines/, which stay at the top level of the repository (the design card)
and install as rlpipe.components and rlpipe.pipelines."""

from setuptools import find_packages, setup

MAPPED = {"components": "rlpipe.components", "pipelines": "rlpipe.pipelines"}

packages = find_packages(include=["rlpipe", "rlpipe.*"])
for folder, name in MAPPED.items():
    packages += [name + found[len(folder) :] for found in find_packages(include=[folder, f"{folder}.*"])]
setup(packages=packages, package_dir={name: folder for folder, name in MAPPED.items()})
