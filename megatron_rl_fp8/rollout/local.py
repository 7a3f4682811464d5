"""In-process rollout engine on transformers: the CPU stand-in for an SGLang server.

It receives weights exactly as a server would (HF names, full tensors from the Megatron->HF sync
path) and samples with ``model.generate``. Per-token logprobs are taken from the raw logits of the
sampled tokens at the sampling temperature, i.e. log softmax(logits / T) — the quantity the trainer
recomputes, so rollout-vs-train mismatch metrics compare like with like.

FP8 rollout (``fp8.weight_quant`` blockwise / per_tensor) runs the numerics of a W8A8 FP8 server:
linear weights arrive as e4m3 codes + ``weight_scale_inv`` (the sync path quantizes them) and are
dequantized on load; every input to those linears is fake-quantized to e4m3 with one dynamic scale
per 1 x ``act_group`` elements, as block-FP8 serving kernels quantize activations on the fly.

A Qwen3-MoE model arrives with HF's per-expert names (``mlp.experts.<e>.gate_proj.weight``, what
the files and SGLang hold); transformers 5 keeps the experts fused in memory (``gate_up_proj``
[experts, 2 x width, hidden] = each expert's [gate; up], ``down_proj`` [experts, hidden, width]), so
each expert's tensor is copied into its slice. Under FP8 rollout the experts' weights are FP8 like
every linear's, and their first GEMM's input (the routed hidden states) is fake-quantized; the
input of their down projection (SwiGLU's output, inside transformers' expert loop) is not: that
one activation stays in the model's dtype here, a gap of this stand-in, not of SGLang.

Syncs: the engine lives in the driver's process, so the driver gathers every pipeline stage's
weights and pushes them all (its :class:`~.base.SyncPlan` leaves ``from_stages`` off); the push
is ``update_weights``. It shares the trainer's memory, so there is none to release or resume.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence

import torch
import transformers

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.fp8.quantize import fake_quant_groups
from megatron_rl_fp8.rollout.base import Completion, SyncPlan, eos_ids, prompt_limits
from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.quantize import dequantize_stream, is_fp8_weight
from megatron_rl_fp8.sync.timing import SyncTimes, timed


class GumbelSampling(transformers.LogitsProcessor):
    """Sampling at ``temperature`` within the ``top_p`` nucleus as a logits processor for greedy
    decoding: the scores at that temperature, cut to the nucleus, plus Gumbel(0, 1) noise from a
    private generator seeded with ``seed``; their argmax is distributed as softmax(logits / T)
    renormalized over the nucleus (the Gumbel-max trick), as HF's own sampler draws it."""

    def __init__(self, temperature: float, top_p: float, seed: int, device: torch.device):
        self.temperature = temperature
        self.top_p = transformers.TopPLogitsWarper(top_p) if top_p < 1.0 else None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        u = torch.rand(
            scores.shape, generator=self.generator, device=scores.device, dtype=torch.float32
        )
        # u in [0, 1): u = 0 gives -inf noise, a token never drawn, as its probability is 0.
        return scores + -torch.log(-torch.log(u))


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _expert_slice(params: dict, name: str) -> tuple[str, torch.Tensor] | None:
    """(fused parameter name, the view of it that HF's per-expert ``name`` fills), or None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    fused = prefix + (".down_proj" if kind == "down" else ".gate_up_proj")
    if fused not in params or e >= params[fused].shape[0]:
        return None
    if kind == "down":
        return fused, params[fused][e]
    half = params[fused].shape[1] // 2
    return fused, params[fused][e, :half] if kind == "gate" else params[fused][e, half:]


class InProcessSender:
    """The driver's side of a sync into the in-process engine: the buckets go straight to its
    ``update_weights``, whose time less the stream it pulls is the sync's engine load."""

    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self.times = SyncTimes()

    def push(self, plan: SyncPlan, buckets: Iterable[Bucket]) -> str | None:
        pulled = SyncTimes()
        t0 = time.perf_counter()
        self.engine.update_weights(timed(buckets, pulled, "export"), version=plan.version)
        self.times = SyncTimes(load=time.perf_counter() - t0 - pulled.export)
        return None  # an incomplete update raises (update_weights)

    def close(self) -> None:
        """Nothing to let go: the engine is in this process, and it owns no connection."""


class LocalEngine:
    def __init__(
        self,
        hf_config,
        *,
        pad_token_id: int,
        eos_token_id: int | Iterable[int],
        dtype=torch.float32,
        fp8: RolloutFP8Config | None = None,
        device: str | torch.device = "cpu",
        return_routes: bool = False,
    ):
        """``return_routes``: a mixture-of-experts model's completions carry the experts each
        token went to (``Completion.routed_experts``; ``rollout.routing_replay``)."""
        self.device = torch.device(device)
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        self.model.to(self.device).eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_ids(eos_token_id)
        self.fp8 = fp8 or RolloutFP8Config()
        self._version = -1
        # One batched call generates every row: nothing waits on a slower engine.
        self.wait_s = 0.0
        self.sender = InProcessSender(self)
        if self.fp8.enabled:
            self._quantize_linear_inputs()
        # Each MoE layer's router (transformers' Qwen3MoeTopKRouter returns logits, weights,
        # expert ids), in layer order; its expert ids of every forward while capturing.
        self._routes: list[list[torch.Tensor]] | None = None
        self._routers = []
        if return_routes:
            self._routers = [
                layer.mlp.gate for layer in self.model.model.layers if hasattr(layer.mlp, "gate")
            ]
            if not self._routers:
                raise ValueError("return_routes: the model has no mixture-of-experts layers")
            for i, router in enumerate(self._routers):
                router.register_forward_hook(self._capture(i))

    def _capture(self, layer: int):
        def hook(_module, _args, output) -> None:
            if self._routes is not None:
                self._routes[layer].append(output[2])  # [rows x positions, k]

        return hook

    def _quantize_linear_inputs(self) -> None:
        group = self.fp8.act_group

        def hook(_module, args):
            return (fake_quant_groups(args[0], group=group),) + tuple(args[1:])

        for name, module in self.model.named_modules():
            if isinstance(module, torch.nn.Linear) and is_fp8_weight(name + ".weight"):
                module.register_forward_pre_hook(hook)
            elif name.endswith(".mlp.experts") and hasattr(module, "gate_up_proj"):
                module.register_forward_pre_hook(hook)  # the routed hidden states (docstring)

    # -- weights -------------------------------------------------------------------------------
    @property
    def export_options(self) -> dict:
        # FP8 weights arrive as codes + scales and are dequantized here, on load, exactly as a
        # W8A8 server would read them; buckets only bound the size of one message.
        return {"bucket_mb": 512, "dequantize_to": None}

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket], *, version: int) -> None:
        params = dict(self.model.named_parameters())
        seen = set()
        dtype = next(iter(params.values())).dtype
        named = (nt for bucket in buckets for nt in bucket.tensors)
        pieces: dict[str, int] = {}  # fused expert parameter -> expert tensors received
        for name, tensor in dequantize_stream(named, block=self.fp8.weight_block, dtype=dtype):
            target = (name, params[name]) if name in params else _expert_slice(params, name)
            if target is None:
                raise KeyError(
                    f"engine has no parameter {name!r}; the HF mapping and model disagree"
                )
            if target[1].shape != tensor.shape:
                raise ValueError(
                    f"{name}: engine shape {tuple(target[1].shape)} != sent {tuple(tensor.shape)}"
                )
            target[1].copy_(tensor)
            if target[0] == name:
                seen.add(name)
            else:
                pieces[target[0]] = pieces.get(target[0], 0) + 1
        for fused, n in pieces.items():  # each expert's down, or its gate and its up
            if n == params[fused].shape[0] * (1 if fused.endswith(".down_proj") else 2):
                seen.add(fused)
        missing = set(params) - seen
        if self.model.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            # Never serve a mix of versions silently.
            self._version = -1
            raise RuntimeError(f"weight update incomplete, missing {sorted(missing)[:5]}...")
        self._version = version

    def begin_sync(self, version: int) -> SyncPlan:
        return SyncPlan(version=version, export_options=self.export_options)

    def end_sync(self, plan: SyncPlan, errors: list[str | None]) -> None:
        """Nothing to finish: the push loaded every weight or raised."""

    # -- memory: shared with the trainer (colocated placement is for server engines) ----------
    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Nothing to release: this engine's weights and cache are ordinary tensors of the
        trainer's process, freed with it."""

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Nothing to resume (see :meth:`release_memory`)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def weight_version(self) -> int:
        return self._version

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.model = None

    # -- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        greedy: bool = False,
    ) -> list[Completion]:
        limits = prompt_limits(max_new_tokens, len(prompts))
        expanded = [p for p in prompts for _ in range(n)]
        width = max(len(p) for p in expanded)
        # Decoder-only generation wants left padding so every row's next token is at the end.
        input_ids = torch.full((len(expanded), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(input_ids)
        for i, p in enumerate(expanded):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        # Sampling draws from a generator of its own, seeded per call, never from torch's global
        # one: the trainer's forward passes set that one (Megatron's RNG tracker) while a
        # pipelined rollout generates in another thread (trainer/pipeline.py). Greedy decoding
        # of the noised scores is the sample (Gumbel-max).
        processors = [] if greedy else [GumbelSampling(temperature, top_p, seed, self.device)]
        if self._routers:
            self._routes = [[] for _ in self._routers]
        try:
            out = self._generate(input_ids, attn, max(limits), processors)
        finally:
            routes, self._routes = self._routes, None
        new_tokens = out.sequences[:, width:]
        # logits: tuple over generated positions of [N, V] raw (pre-processor) logits.
        logits = torch.stack(out.logits, dim=1).float()
        t = 1.0 if greedy else temperature
        logp = torch.log_softmax(logits / t, dim=-1).gather(-1, new_tokens[..., None])[..., 0]
        # One device-to-host copy of the whole rollout.
        new_tokens, logp = new_tokens.cpu(), logp.cpu()
        if routes is not None:
            # Every forward's ids per layer (the prompt's, then one position per new token) as
            # [rows, positions fed, layers, k], on the host.
            rows = len(expanded)
            routes = torch.stack(
                [
                    torch.cat([r.reshape(rows, -1, r.shape[-1]) for r in layer], 1)
                    for layer in routes
                ],
                dim=2,
            ).to("cpu", torch.int16)
        completions = []
        for i, p in enumerate(expanded):
            # A row's own limit cuts it where generating to that limit would have stopped.
            toks = new_tokens[i, : limits[i // n]].tolist()
            # The first end id ends the completion (generate pads the row after it).
            stop = next((j for j, t in enumerate(toks) if t in self.eos_token_ids), None)
            finished = stop is not None
            length = stop + 1 if finished else len(toks)
            completions.append(
                Completion(
                    prompt_ids=list(p),
                    response_ids=toks[:length],
                    response_logprobs=logp[i, :length].tolist(),
                    finished=finished,
                    version=self._version,
                    # The prompt's positions (left padding dropped) and every response token's
                    # but the last, which was never fed back.
                    routed_experts=(
                        routes[i, width - len(p) : width + length - 1].clone()
                        if routes is not None
                        else None
                    ),
                )
            )
        return completions

    def _generate(self, input_ids, attn, max_new_tokens: int, processors):
        return self.model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            logits_processor=transformers.LogitsProcessorList(processors),
            pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_ids),
            output_logits=True,
            return_dict_in_generate=True,
        )
