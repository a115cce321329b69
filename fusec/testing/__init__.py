"""Helpers for test suites, fusec's own and those of engines that embed it.

`fusec.testing.golden`: record a model's greedy outputs with the fp32 reference and check a
compiled step against them (`fusec golden record/check`); `fusec.testing.pytest_plugin`: the
same as a pytest fixture (docs/golden.md).
"""
