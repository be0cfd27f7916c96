"""The redlite demo model: a small Qwen3-Next (transformers' Qwen3NextForCausalLM) plus a multi-token-prediction
(MTP) head laid out like the released Qwen3-Next `mtp.*` tensors.

MTP (as in the Qwen3-Next release / vLLM): for slot t (predicting token t+2)
    u = fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
where h_t is the trunk's final (post-`model.norm`) hidden state; u runs through one full-attention decoder layer
(own MoE, causal over the slots, RoPE position t), then `mtp.norm` and the shared `lm_head`.
"""
import copy

import torch
import torch.nn as nn
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm


def demo_config(vocab_size: int = 10240) -> Qwen3NextConfig:
    """Hyperparameters of the shipped demo model (about 29.6 M parameters with its MTP block)."""
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=768,  # unused: every layer is MoE
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=160,
        shared_expert_intermediate_size=160,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
    )


class MtpHead(nn.Module):
    """The Qwen3-Next MTP module; parameter names match the release checkpoint's `mtp.*` keys."""

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        h = config.hidden_size
        cfg = copy.deepcopy(config)
        cfg.layer_types = ["full_attention"]
        cfg.num_hidden_layers = 1
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(cfg, 0)])
        self.norm = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, position_ids):
        """next_embeds = embed(x_{t+1}), hidden = h_t (post-norm), both [B, S, H]; returns pre-lm_head states."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # Causal over the slots. An explicit additive mask works with every attention implementation
        # (training ran sdpa with mask None, which sdpa treats as causal: the same thing).
        s = u.shape[1]
        mask = torch.full((s, s), float("-inf"), dtype=u.dtype, device=u.device).triu(1)[None, None]
        for layer in self.layers:
            u = layer(u, position_embeddings=position_embeddings, attention_mask=mask, position_ids=position_ids)
        return self.norm(u)


class DemoModel(nn.Module):
    """Trunk (`model.*`, `lm_head.*`) and MTP head (`mtp.*`) under the HF checkpoint names."""

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        self.lm = Qwen3NextForCausalLM(config)
        self.mtp = MtpHead(config)
        with torch.no_grad():  # (1 + w) norms start at w = 0, as HF initialises them
            for m in self.mtp.modules():
                if isinstance(m, Qwen3NextRMSNorm):
                    m.weight.zero_()
            std = config.initializer_range
            moe = self.mtp.layers[0].mlp
            moe.experts.gate_up_proj.normal_(0.0, std)
            moe.experts.down_proj.normal_(0.0, std)
            moe.gate.weight.normal_(0.0, std)

    def hf_state_dict(self) -> dict:
        """State dict under HF checkpoint names (`model.*`, `lm_head.weight`, `mtp.*`)."""
        sd = {}
        for k, v in self.lm.state_dict().items():
            sd[k] = v
        for k, v in self.mtp.state_dict().items():
            sd["mtp." + k] = v
        return sd

    def load_hf_state_dict(self, sd: dict):
        lm = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
        mtp = {k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}
        self.lm.load_state_dict(lm, strict=True)
        self.mtp.load_state_dict(mtp, strict=True)

    def forward(self, ids: torch.Tensor, with_router_logits: bool = False):
        """ids [B, T]. Returns (main logits [B,T,V], mtp logits [B,T-1,V] for slots 0..T-2, aux loss or None).

        MTP slot t uses h_t and embed(ids[t+1]) and predicts ids[t+2] (targets exist for t <= T-3)."""
        out = self.lm.model(input_ids=ids, output_router_logits=with_router_logits)
        h = out.last_hidden_state
        logits = self.lm.lm_head(h)
        aux = None
        if with_router_logits:
            from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

            aux = load_balancing_loss_func(out.router_logits, self.lm.config.num_experts, self.lm.config.num_experts_per_tok)
        s = ids.shape[1] - 1
        emb = self.lm.model.embed_tokens(ids[:, 1:])
        pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        pe = self.lm.model.rotary_emb(emb, pos)
        m = self.mtp(emb, h[:, :s].detach(), pe, pos)
        return logits, self.lm.lm_head(m), aux


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
