"""One module per kernel family: its parameter list, spec (config -> Specialization), coverage rule
and launch plan (docs/architecture.md). ``ultraquant.kernels.catalog`` lists them."""
