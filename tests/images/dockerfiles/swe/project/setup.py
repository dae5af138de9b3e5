from setuptools import setup

setup(name="calc", version="0.1.0", packages=["calc"])
