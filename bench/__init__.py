"""The benchmarks (`canvas-ls bench ...`): figures, not pass/fail; each prints a table, writes a JSON report and, where
a curve says more, a PNG. Installed with the package; their plots need the `[bench]` extra (matplotlib). Nothing on
the language server's keystroke path imports this package (tests/test_packaging.py checks it)."""
