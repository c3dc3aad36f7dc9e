# horovod-alq developer targets. `make test` is all a new machine needs (it installs first).
PY     := .venv/bin/python
NP     ?= 2
MPIRUN := mpirun --allow-run-as-root --oversubscribe --bind-to none \
          --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none \
          --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo
# Extra pytest arguments, e.g. make test PYTEST_ARGS="-k torch -x"
PYTEST_ARGS ?=

.PHONY: install test demo clean

install:
	bash scripts/install.sh

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

# A 2-rank Horovod sanity job. The training demo with the adaptive compressors arrives with the
# PyTorch compressor.
demo: install
	OMP_NUM_THREADS=1 $(MPIRUN) -np $(NP) $(PY) scripts/hello_horovod.py

# Removes the venv and build leftovers; the Horovod wheel cache (~/.cache/horovod-alq) stays.
clean:
	rm -rf .venv build dist *.egg-info .pytest_cache .hypothesis
