# The two newcomer commands (see README.md): `make serve` and `make test`.
.PHONY: install serve test bench

install:
	bash scripts/install.sh

serve: install
	.venv/bin/spyre-serve run serve_config.yaml

test: install
	.venv/bin/python -m pytest -q --durations=40 tests

bench: install
	.venv/bin/python bench/compare_vllm.py
