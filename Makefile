# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv with the pinned dependencies first (once; again when the pins change).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench clean

# backend='xla' needs jax/jaxlib in .venv itself (the tf_gspmd[xla] extra,
# requirements-xla.lock: same numpy and ml_dtypes as TF); `make test` installs it there,
# `make demo` does not need it. The tests' JAX children (XLA's own partitioner to compare
# against, Keras on JAX in the bench smoke tests) run on .venv's Python with
# KERAS_BACKEND=jax: same jax and Keras. `make bench` runs its Keras-on-JAX peers from a venv
# of their own (.jaxenv: jax and Keras only), so that TF's presence costs them nothing.
JAXENV ?= .jaxenv
JAXSTAMP := $(JAXENV)/.installed
JAX_VERSION := 0.10.2
# Keras 3 on JAX (bench/step_time.py's keras.distribution peer): the Keras version of .venv.
KERAS_VERSION := $(shell sed -n 's/^keras==//p' requirements.lock)

$(JAXSTAMP):
	$(PYTHON) -m venv $(JAXENV)
	$(JAXENV)/bin/pip install -q --upgrade pip
	$(JAXENV)/bin/pip install -q jax==$(JAX_VERSION) jaxlib==$(JAX_VERSION) keras==$(KERAS_VERSION)
	touch $(JAXSTAMP)

$(STAMP): requirements.lock requirements-test.lock setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock -r requirements-test.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/keras/demo.py

XLASTAMP := $(VENV)/.installed-xla

$(XLASTAMP): $(STAMP) requirements-xla.lock
	$(PY) -m pip install -q -r requirements.lock -r requirements-xla.lock
	touch $(XLASTAMP)

# The second pass runs the tests whose numbers depend on which CPU kernels TF picks again on
# its other kernels (oneDNN off): convolutions, batch norms, matmuls and bfloat16 in training
# steps compared by the oracle (architectures, Keras fit and distribution, one device, mixed
# bfloat16). Sums land in another order there, and every such comparison must hold on both.
# Not in it: the XLA-backend files (XLA's own CPU kernels, which TF_ENABLE_ONEDNN_OPTS does
# not change) and the workflow tests (export, save, callbacks, functions: what they check is
# which value a variable holds, not the kernels' rounding). Its tests are spread one by one
# (worksteal): by file, the architecture file alone set the pass's time. Left out too: the
# page and the example of keras_distribution, run in fresh interpreters; they train the
# Keras guide's model that test_model_parallel_guide_code_matches_plain_keras trains here.
# Of the architecture training steps it runs each block kind's kernels once in each style:
# the raw ResNet (height x width), MobileNetV2 (height) and EfficientNet (batch x height,
# squeeze-excite) and the Keras MobileNetV2 (batch x height: Keras' batch norm, depthwise and
# padding layers); the five pairs left out run the same kernels on other splits (57 CPU s).
ARCH := tests/test_architectures.py
SECOND_PASS_TESTS := tests/test_keras_distribution.py tests/test_keras_fit.py \
	$(ARCH) tests/test_one_device.py \
	tests/test_keras_workflow.py::test_mixed_bfloat16 \
	tests/test_keras_workflow.py::test_unannotated_output_kernel_replicated_across_train_evaluate_predict \
	--deselect tests/test_keras_distribution.py::test_readme_keras_distribution_section_runs \
	--deselect tests/test_keras_distribution.py::test_example_trains_model_parallel_with_keras_progress_bar \
	--deselect "$(ARCH)::test_keras_training_step[efficientnet-batch_height]" \
	--deselect "$(ARCH)::test_keras_training_step[resnet-batch]" \
	--deselect "$(ARCH)::test_raw_tf_training_step[efficientnet-height]" \
	--deselect "$(ARCH)::test_raw_tf_training_step[resnet-batch]" \
	--deselect "$(ARCH)::test_raw_tf_training_step[mobilenet_v2-height_width]"

# Lint and import order (ruff), the format check (ruff format) and types on the pure
# modules (mypy, files listed in pyproject.toml). Configured in pyproject.toml.
LINTED := tf_gspmd tests bench examples setup.py
lint: $(STAMP)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy

# Two pytest workers (pytest-xdist), a test file each at a time: one process alone keeps about
# one of the two cores busy (graph building is single-threaded Python). The slowest tests are
# listed at the end, so the suite's time can be watched from the CI log. `make test` installs
# all the suite needs, so nothing may skip there (TF_GSPMD_NO_SKIPS=1 fails a skip, naming
# why; tests/conftest.py); -rs reports the skips of other runs.
PYTEST_WORKERS ?= 2
test: $(STAMP) $(XLASTAMP) lint
	TF_GSPMD_NO_SKIPS=1 TF_GSPMD_JAX_PYTHON=$(PY) $(PY) -m pytest -q -rs \
	  -n $(PYTEST_WORKERS) --dist loadfile --durations=25 tests
	TF_GSPMD_NO_SKIPS=1 TF_ENABLE_ONEDNN_OPTS=0 TF_GSPMD_JAX_PYTHON=$(PY) \
	  $(PY) -m pytest -q -rs -n $(PYTEST_WORKERS) --dist worksteal $(SECOND_PASS_TESTS)

# A quick loop for development: skips the tests marked slow (CI runs them all).
test-fast: $(STAMP) $(XLASTAMP)
	TF_GSPMD_JAX_PYTHON=$(PY) $(PY) -m pytest -q -rs -n $(PYTEST_WORKERS) --dist worksteal \
	  --durations=10 tests -m "not slow"

# The benchmarks (their latest output goes in the closing notes). The full op sweep
# (18,932 cases) takes two to three hours on 2 cores: `nice $(PY) bench/op_sweep.py`;
# here it runs its CI sample. vs_xla runs tf_gspmd's XLA backend beside XLA's own partitioner.
bench: $(STAMP) $(XLASTAMP) $(JAXSTAMP)
	$(PY) bench/partition_scaling.py
	$(JAXENV)/bin/python bench/xla_reference.py > bench/xla_reference.json
	$(PY) bench/reshard.py --xla bench/xla_reference.json
	$(PY) bench/step_time.py
	$(PY) bench/vs_xla.py
	$(PY) bench/reshard_xla.py
	$(PY) bench/op_sweep.py --sample 2

clean:
	rm -rf $(VENV) $(JAXENV) build *.egg-info
