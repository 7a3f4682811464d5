"""What the benchmarks and the planner's validations measure with, shared by ``benchmarks/``,
``scripts/`` and the tests (scripts import the package, never each other).

* the FLOP convention of the step-time model and of ``benchmarks/bench_actor.py``'s MFU
  (:func:`flops_per_token`), and the model a preset's name stands for (:func:`preset_model`);
* the ~21M-parameter shape of the CPU validations (:data:`SHAPE_20M`) and the overrides of a
  timing run (:data:`TIMING_RUN`, :data:`TIMING_20M`);
* peak live tensor bytes per profiler window (:func:`peak_bytes`) and the bytes a layer saves for
  its backward (:class:`FirstLayerSaved`): the CPU counterparts of ``torch.cuda``'s memory stats.
"""

from __future__ import annotations

from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.plan.presets import BENCH_ACTOR_2B, PRESETS

# ~21M parameters: 4 layers of width 512 (8 query / 4 KV heads of 64, SwiGLU 1536), vocab 8192
# (untied).
SHAPE_20M = [
    "model.num_layers=4",
    "model.hidden_size=512",
    "model.ffn_hidden_size=1536",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.vocab_size=8192",
]
# A timing run: no SFT warm start, no checkpoint; the evaluation still runs before the first and
# after the last step (on few prompts) and is timed under its own key, outside the step.
TIMING_RUN = [
    "sft.steps=0",
    "train.save_interval=0",
    "train.eval_interval=0",
    "train.eval_prompts=16",
]
# The ~21M shape on 16 prompts x 8 samples (the step-time validation's and the calibration
# benchmark's larger model).
TIMING_20M = [*SHAPE_20M, "train.prompts_per_step=16", "train.micro_batch_size=16"]


def preset_model(shape: str = "2b", seq: int = 2048, *, layers: int = 0) -> ModelConfig:
    """The bf16 model of ``shape``: '2b' (``BENCH_ACTOR_2B``, the measured reference actor) or a
    ``plan.presets`` name, ``layers`` deep (0: the shape's own), for sequences of ``seq``."""
    fields = dict(BENCH_ACTOR_2B if shape == "2b" else PRESETS[shape])
    if layers:
        fields["num_layers"] = layers
    return ModelConfig(**fields, max_position_embeddings=seq, params_dtype="bfloat16")


def flops_per_token(mc: ModelConfig, seq: int) -> tuple[float, int]:
    """(training model FLOPs per token, parameter count) of a Qwen3-shaped ``ModelConfig``: PaLM's
    convention, 6 FLOPs per linear weight (the output layer included, the embedding lookup not)
    plus 12 x layers x seq x query width for attention. ``plan.time.train_flops_per_token`` is
    the same count split in its two terms (a unit test holds them equal)."""
    d, f, layers = mc.hidden_size, mc.ffn_hidden_size, mc.num_layers
    q_width = mc.num_attention_heads * mc.kv_channels
    kv_width = mc.num_query_groups * mc.kv_channels
    vocab = mc.padded_vocab_size()
    per_layer = d * (q_width + 2 * kv_width) + q_width * d + d * 2 * f + f * d
    linear = layers * per_layer + d * vocab  # + the output layer (a GEMM, unlike the embedding)
    norms = layers * (2 * d + 2 * mc.kv_channels) + d  # RMSNorm weights incl. QK-norm
    params = linear + norms + (0 if mc.tie_word_embeddings else d * vocab)
    attention = 12 * layers * seq * q_width
    return 6.0 * linear + attention, params


def peak_bytes(prof, windows: list[str]) -> dict[str, int]:
    """Peak live tensor bytes inside each ``record_function`` window, from the profiler's
    allocation (+) and free (-) events; live bytes count from the start of the profile."""
    events = list(prof.profiler.kineto_results.events())
    spans = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in windows}
    memory = sorted(
        ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"),
        key=lambda x: x[0],
    )
    peaks = dict.fromkeys(windows, 0)
    live = 0
    for t, nbytes in memory:
        live += nbytes
        for name, (start, end) in spans.items():
            if start <= t <= end:
                peaks[name] = max(peaks[name], live)
    return peaks


class FirstLayerSaved:
    """Bytes the first transformer layer saves for its backward in its first forward: every
    tensor autograd packs while the layer runs, once per storage (a view keeps its whole base
    alive), parameters excluded. Use ``pack`` as a ``saved_tensors_hooks`` pack hook."""

    def __init__(self, module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: dict[int, int] = {}
        self.active = self.done = False
        layer = module.decoder.layers[0]
        layer.register_forward_pre_hook(self._start)
        layer.register_forward_hook(self._stop)

    def _start(self, *_):
        self.active = not self.done

    def _stop(self, *_):
        self.active, self.done = False, True

    def pack(self, t):
        if self.active:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params:
                self.seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())
