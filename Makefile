# Thin aliases for ./run, which does the work (and needs nothing but Python 3 and bash).
.PHONY: setup test report lab bench
setup test report lab bench:
	./run $@
