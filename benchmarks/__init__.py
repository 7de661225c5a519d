"""megactx benchmarks: `megactx bench kernels` (and later `bench engine`, `bench spec`).

Benchmarks are not tests: they time the code on the machine they run on, measure that machine's
ceilings and every peer in the same run, and write JSON + Markdown + PNG under
`benchmarks/results/`. benchmarks/README.md says how to run them and what each figure means.
"""
