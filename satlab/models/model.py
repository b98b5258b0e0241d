"""The decoder-only language model every architecture shares: embedding, blocks chained by a depth loop, final
RMSNorm, tied LM head, and KV-cached generation."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from satlab.models.cache import KVCache
from satlab.models.layers import RMSNorm, Rotary, rms_norm
from satlab.models.parametrization import INPUT, ParamClass, ParamDecl, multipliers, own_std, parameter_table
from satlab.models.streams import DepthContext


class ModelOutput(NamedTuple):
    logits: Tensor
    gates: list[Tensor | None] | None  # per layer, (B, T, G, C), when asked for with return_gates=True


class DecoderLM(nn.Module):
    """A language model assembled by :func:`satlab.models.build_model` from a registry entry.

    ``value_paths[i]`` is layer i's value path (None: attend with V_i unchanged); ``value_shared`` computes
    per-forward weights shared across layers (the learnable ResFormer); ``stream`` is the depth loop;
    ``architecture`` the registry entry it was built from.

    ``model.parametrization`` (:mod:`satlab.models.parametrization`): building derives the parameter table (and fails
    on a parameter no module declares), re-initialises what μP re-scales, and sets the forward multipliers.
    """

    param_classes = {"embed.weight": INPUT,
                     "lm_head.weight": ParamDecl(ParamClass.OUTPUT, std=own_std, logits=True)}

    def __init__(self, cfg, stream: nn.Module, value_paths: list[nn.Module | None], value_shared: nn.Module | None,
                 architecture=None):
        super().__init__()
        self.cfg = cfg
        self.architecture = architecture
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.stream = stream
        self.blocks = nn.ModuleList(stream.make_block(cfg, i, value_paths[i]) for i in range(cfg.n_layers))
        self.value_shared = value_shared
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, impl=cfg.mixing_impl)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.multipliers = multipliers(cfg, architecture)
        for block in self.blocks:
            block.set_branch_multiplier(self.multipliers.branch)  # CompleteP: residual branches x m_L^-alpha
            block.attn.attn_scale = self.multipliers.attention  # μP: attention logits / d_head off the base head dim
        self.param_rules = parameter_table(self, cfg)  # refuses a parameter no module declares
        self.init_weights()
        self.register_load_state_dict_pre_hook(_scalars_as_vectors)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The spec's init: every Linear and the embedding N(0, init_std), norms 1, then each variant part's own;
        the embedding N(0, embed_init_std) where that is set."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if self.cfg.embed_init_std is not None:
            nn.init.normal_(self.embed.weight, std=self.cfg.embed_init_std)
        if hasattr(self.stream, "output_init_std"):
            for block in self.blocks:
                nn.init.normal_(block.attn.o_proj.weight, std=self.stream.output_init_std(std))
                if block.mlp is not None:
                    nn.init.normal_(block.mlp.down_proj.weight, std=self.stream.output_init_std(std))
        for module in self.modules():
            if module is not self and hasattr(module, "init_weights"):
                module.init_weights()
        params = dict(self.named_parameters())
        for name, rule in self.param_rules.items():
            if rule.init_std is not None:  # μP: the init std its class derives from the base width's
                nn.init.normal_(params[name], std=rule.init_std)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, idx: Tensor, cache: KVCache | None = None, return_gates: bool = False,
                select: Tensor | None = None) -> ModelOutput:
        """Logits (B, T, vocab) for token ids (B, T); with a cache, ``idx`` continues the cached sequence.

        ``select``, a (B, T) bool mask, computes the head only at those positions and returns logits (n, vocab) in
        row-major order of the mask: a task scored at a few answer positions (synthetic recall) skips the
        vocabulary projection everywhere else, which is most of a small model's cost.
        """
        start = 0 if cache is None else cache.length
        rope = self.rotary.tables(start, idx.shape[1])
        v1_weights = self.value_shared() if self.value_shared is not None else None
        ctx = DepthContext(self.blocks, rope, v1_weights, cache, idx)
        x = self.stream(self.embed(idx), ctx)
        if select is not None:
            x = x[select]
        if self.multipliers.logits != 1.0:  # μP: logits x 1/m_w, folded into the final norm's gain
            h = rms_norm(x, self.norm.weight * self.multipliers.logits, self.norm.eps, self.norm.impl)
        else:
            h = self.norm(x)
        logits = nn.functional.linear(h, self.lm_head_weight)
        return ModelOutput(logits, ctx.gates if return_gates else None)

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        cfg = self.cfg
        max_len = max_len or cfg.max_seq_len
        param = self.embed.weight
        return KVCache(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim, param.device, param.dtype)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 eos_id: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Continue ``idx`` (B, T) by up to ``max_new_tokens`` with the KV cache; greedy when temperature is 0.

        Stops early once every sequence has produced ``eos_id``. Returns (B, T + new) token ids.
        """
        cache = self.new_cache(idx.shape[0], idx.shape[1] + max_new_tokens)
        logits = self(idx, cache=cache).logits[:, -1]
        out = [idx]
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, generator)
            out.append(nxt)
            if eos_id is not None:
                finished |= nxt.squeeze(-1) == eos_id
                if bool(finished.all()):
                    break
            logits = self(nxt, cache=cache).logits[:, -1]
        return torch.cat(out, dim=1)

    def no_weight_decay(self) -> set[str]:
        """Names of parameters that the variant marks as static mixing weights (no weight decay)."""
        names = set()
        for prefix, module in self.named_modules():
            for local in getattr(module, "no_weight_decay_params", ()):
                names.add(f"{prefix}.{local}" if prefix else local)
        return names

    def lr_groups(self) -> dict[str, str]:
        """Parameter name -> the learning-rate group its module declares (``lr_group``, e.g. SATFormer's gates)."""
        groups = {}
        for prefix, module in self.named_modules():
            if group := getattr(module, "lr_group", None):
                groups.update({f"{prefix}.{name}": group for name, _ in module.named_parameters()})
        return groups

    def mixing_weights(self) -> dict:
        """Static depth/value mixing weights for plots (:class:`~satlab.models.architecture.MixingWeight` by
        ``family/name``): what the architecture declares, else its depth loop's."""
        if self.architecture is not None and self.architecture.mixing_weights is not None:
            return self.architecture.mixing_weights(self)
        return dict(self.stream.mixing_weights())


def _scalars_as_vectors(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Checkpoints from before the scalar mixing parameters became (1,) tensors (FSDP2 shards no 0-dim
    parameter) hold them 0-dim: read those as (1,)."""
    for name, param in module.named_parameters(prefix=prefix.rstrip(".") if prefix else ""):
        value = state_dict.get(name)
        if isinstance(value, Tensor) and value.dim() == 0 and param.shape == (1,):
            state_dict[name] = value.reshape(1)


def sample_next(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """One next token per row (B, 1) from last-position logits (B, vocab)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
