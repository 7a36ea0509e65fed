"""tools/bench_loop.py measures what it names: delays injected where each figure must see them
(a slower step, a slower input pipeline) show up in that figure and only there."""

import importlib.util
import json
import time

from conftest import REPO, TINY

STEP_DELAY_S = 0.03  # added to every bare step
INPUT_DELAY_S = 0.15  # added before every host batch: far above a real step (~10-20 ms here)


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_loop", REPO / "tools" / "bench_loop.py")
    bench_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_loop)
    return bench_loop


class _Slow:
    """An iterator (grain's, with get_state/set_state/close) that sleeps before each batch."""

    def __init__(self, inner):
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(INPUT_DELAY_S)
        return next(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_bench_loop_figures_see_injected_step_and_input_delays(capsys, monkeypatch):
    bench_loop = _load_tool()
    real_build = bench_loop.build_components

    class WithSlowStep:
        """The tool's components, but the compiled step it times sleeps first."""

        def __init__(self, parts):
            self._parts = parts

        def __getattr__(self, name):
            return getattr(self._parts, name)

        def lower_train_step(self):
            parts = self._parts

            class Lowered:
                def compile(self):
                    compiled = parts.lower_train_step().compile()

                    def slow_step(state, batch):
                        time.sleep(STEP_DELAY_S)
                        return compiled(state, batch)

                    slow_step.memory_analysis = compiled.memory_analysis  # for the heap setting
                    return slow_step

            return Lowered()

    import hopperjax.trainer.loop as loop

    real_make = bench_loop.make_iterator
    monkeypatch.setattr(bench_loop, "build_components", lambda c: WithSlowStep(real_build(c)))
    monkeypatch.setattr(bench_loop, "make_iterator", lambda *a: _Slow(real_make(*a)))
    monkeypatch.setattr(loop, "make_iterator", lambda *a: _Slow(real_make(*a)))
    # Log windows of 5 steps: the loop's step time leaves out its logging, during which the slow
    # pipeline keeps reading ahead. With one batch of device prefetch, at most two batches of a
    # window are read before its clock starts (one queued, one held by the reading thread).
    args = [str(REPO / "configs" / "quickstart.yaml"), *TINY, "train.log_every=5",
            "data.device_prefetch=1"]  # fmt: skip
    # Overrides may follow flags: the last one comes after --chunk.
    argv = ["--config", *args[:-1], "--steps", "10", "--chunk", "5", args[-1]]
    assert bench_loop.main([*argv, "--pipeline-batches", "10"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 8
    # (d) the GPT's preprocessing is the identity; its batch is two int32 [16, 32] arrays.
    assert report["preprocess_s"] >= 0 and report["batch_bytes_to_device"] == 2 * 4 * 16 * 32
    # (a) the bare step: batches already on the device, so the input delay is not in it.
    assert STEP_DELAY_S <= report["bare_step_s"] < STEP_DELAY_S + INPUT_DELAY_S
    # (b) the loop reads every batch through the slow pipeline: each 5-step window waits for at
    # least 3 fresh reads (sleeps are never shorter than asked), so >= 0.6 x the input delay,
    # twice the bare step's delay. (0.75 x, which assumed less read-ahead, failed once in CI.)
    assert report["loop_step_s"] >= INPUT_DELAY_S * 3 / 5
    # (c) the pipeline alone, on the host and assembled on the devices.
    for key in ("host_batches_per_s", "device_batches_per_s"):
        assert 0.3 / INPUT_DELAY_S < report[key] <= 1.0 / INPUT_DELAY_S, (key, report[key])
    # An input-bound setup is not "ok": the pipeline does not feed 5x what the step consumes.
    assert report["pipeline_over_step"] < 5.0 and report["ok"] is False
