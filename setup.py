"""Installs tf_gspmd (`pip install .`); pinned versions live in requirements.lock."""
from setuptools import find_packages, setup

setup(
    name='tf_gspmd',
    version='0.1.0',
    description='GSPMD for TensorFlow: sharding annotations, propagation and SPMD partitioning.',
    packages=find_packages(include=['tf_gspmd', 'tf_gspmd.*']),
    python_requires='>=3.10',
    install_requires=['tensorflow-cpu>=2.21,<2.22', 'numpy', 'protobuf', 'absl-py'],
    extras_require={
        'keras': ['keras>=3'],
        'test': ['pytest', 'hypothesis'],
        'jax': ['jax', 'jaxlib'],
        # backend='xla': compile the exported StableHLO with XLA and run it through PJRT.
        'xla': ['jax==0.10.2', 'jaxlib==0.10.2'],
    },
)
