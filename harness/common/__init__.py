"""The shared vocabulary every stage speaks: errors and exit codes (:mod:`.errors`), precision
names (:mod:`.dtypes`), the rank mesh (:mod:`.mesh`), placements and shard layouts
(:mod:`.layout`), atomic JSON files (:mod:`.jsonio`) and the compiled loops (:mod:`.kernels`).
It imports nothing else of the harness."""
