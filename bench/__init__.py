"""ql3 benchmarks (SPEC section 12): ``make bench`` or ``python -m bench``; see README.md."""
