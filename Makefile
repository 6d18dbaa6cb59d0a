# The two commands of the README are `make lab` and `make test`; the rest are conveniences.
.PHONY: setup lab test docs export clean reproduce
export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1
export PLOTLY_RENDERER = plotly_mimetype
export TOKENIZERS_PARALLELISM = false
BIN = .venv/bin

setup:
	@bash tools/setup.sh

# the main job: JupyterLab on the notebooks, bound to 127.0.0.1
lab: setup
	@$(BIN)/python tools/lab.py

# the whole suite: package in sync, notebooks clean, every notebook in quick mode (each method's one quick run), pytest,
# docs, browser, the optional extras' tests (WORKBENCH_REQUIRE_EXTRAS=1: a missing extra fails, it does not skip);
# every test of 1 s or more is listed with its time, and the total (setup included) is printed with the CPU it ran on
test:
	@t0=$$(date +%s); bash tools/setup.sh --browser && \
	WORKBENCH_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest tests -v -rs --durations=0 --durations-min=1; rc=$$?; \
	echo "make test: exit $$rc after $$(( $$(date +%s) - t0 )) s in all (setup included) on$$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $$(nproc) cores"; \
	exit $$rc

docs: setup
	@$(BIN)/python tools/build_docs.py

export: setup
	@$(BIN)/nbdev-export && $(BIN)/nbdev-clean

# re-run every method's full experiment and rewrite data/results/*.json (hours on 2 cores)
reproduce: setup
	@$(BIN)/workbench run all --full
