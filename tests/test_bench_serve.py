"""benchmarks.bench_serve gives every run (repetition x system) its own dataset seed: two runs with one seed send
the same prompts, and the second one then hits D's prefix cache instead of measuring a prefill."""

from __future__ import annotations

from benchmarks.bench_serve import dataset_seed


def test_every_run_has_its_own_dataset_seed() -> None:
    seeds = [dataset_seed(rep, name) for rep in range(10) for name in ("pd", "colocated")]
    assert len(set(seeds)) == len(seeds)
