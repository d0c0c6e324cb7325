"""Installs tf_gspmd (`pip install .`); pinned versions live in requirements.lock.

TensorFlow is not in install_requires: `tensorflow`, `tensorflow-cpu`, a TPU VM's build and
the nightlies all install the same `tensorflow` package, so requiring one of them would put
a second wheel over the user's own. Extras pick one for a machine that has none
(`pip install tf_gspmd[cpu]`); tf_gspmd/_tf_version.py checks the version at import.
"""

from setuptools import find_packages, setup

TF = '>=2.21,<2.22'  # the line tf_gspmd is tested with; _tf_version.SPECIFIER says the same

setup(
  name='tf_gspmd',
  version='0.1.0',
  description='GSPMD for TensorFlow: sharding annotations, propagation and SPMD partitioning.',
  packages=find_packages(include=['tf_gspmd', 'tf_gspmd.*']),
  # auto_shard's cost constants as measured here, used until calibrate() measures the machine.
  package_data={'tf_gspmd': ['auto_shard_constants.json', 'auto_shard_step_fit.json']},
  python_requires='>=3.10',
  install_requires=['numpy', 'protobuf', 'absl-py'],
  extras_require={
    # One TensorFlow build, for a machine that has none yet.
    'cpu': [f'tensorflow-cpu{TF}'],
    'tensorflow': [f'tensorflow{TF}'],
    'and-cuda': [f'tensorflow[and-cuda]{TF}'],  # NVIDIA GPUs, CUDA libraries from pip
    'keras': ['keras>=3'],
    'test': ['pytest', 'hypothesis'],
    'jax': ['jax', 'jaxlib'],
    # backend='xla': compile the exported StableHLO with XLA and run it through PJRT.
    'xla': ['jax==0.10.2', 'jaxlib==0.10.2'],
  },
)
