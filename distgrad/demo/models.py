"""The demos' models, and how each is split over ranks: the one place the demos, the tests and
the benchmarks build them from. Random weights from a config and a fixed seed; nothing is
downloaded.

- ``build_gpt2``: the tiny GPT-2 of the one-process and data-parallel demos (``build_tokenizer``:
  its byte-level tokenizer).
- ``build_llama`` and ``parallelize_llama``: the tiny Llama of the tensor-parallel demo and its
  Megatron-style plan (HF's GPT-2 uses Conv1D, which torch's tensor parallel styles do not split).
- ``Net``, ``build_mlp``, ``Blocks``, ``layers_of``, ``stage_of``, ``interleaved_stages``: the
  4-block MLP of the pipeline demo and its stages.

A leaf: it imports nothing of the demos. transformers (2 to 3 s), torch.distributed.pipelining
(about 1 s) and torch.distributed.tensor are imported inside the functions that need them, so
that a job using only the MLP, or only one process, does not pay for them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn


def build_gpt2(n_layer: int = 2) -> nn.Module:
    """A tiny GPT-2 (d_model 64, 2 heads, a 384-token vocabulary) in eval mode, seed 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # the tiny vocabulary makes the config warn about its bos/eos ids
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=64, n_head=2, vocab_size=384)).eval()


def build_tokenizer():
    """ByT5's byte-level tokenizer: no vocabulary file to download, ids below 384."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def build_llama(layers: int = 2) -> nn.Module:
    """A tiny Llama (d_model 64, 4 heads, 2 key-value heads, untied head) in eval mode, seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


def parallelize_llama(model: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """Split each decoder layer's projections over ``mesh`` (torch's Megatron-style plan):
    attention and MLP projections column- then row-wise.

    With ``sequence_parallel`` the residual stream is also split along the sequence (norms run
    ``SequenceParallel``); HF Llama then needs ``position_ids`` passed explicitly, because it
    derives them from the (local) sequence length."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    out = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=out),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=out),
    }
    if sequence_parallel:
        parallelize_module(
            model,
            mesh,
            {
                "model.embed_tokens": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1)
                ),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
        plan.update(
            {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                # HF passes the attention's input by keyword only
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


class Net(nn.Module):
    """Four Linear+Tanh blocks: small enough to split over 1, 2 or 4 ranks."""

    def __init__(self, width: int = 8, blocks: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Blocks(nn.Module):
    """One pipeline stage: some of the model's own blocks, in order (the same objects, so the
    whole model's paths name them)."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_mlp(width: int = 8, blocks: int = 4) -> Net:
    """The pipeline demo's MLP, seed 0: every rank builds the same weights and keeps its blocks."""
    torch.manual_seed(0)
    return Net(width, blocks)


def layers_of(net: Net, rank: int, world: int, interleaved: bool = False) -> list[int]:
    """The indices of the blocks ``rank`` runs: a contiguous share, or (interleaved) one block
    per stage, round robin (rank r: r, r + world, ...)."""
    if interleaved:
        return list(range(rank, len(net.layers), world))
    per = len(net.layers) // world
    return list(range(rank * per, (rank + 1) * per))


def stage_of(net: Net, rank: int, world: int):
    """``rank``'s one stage: its contiguous share of the blocks, on the CPU."""
    from torch.distributed.pipelining import PipelineStage

    per = len(net.layers) // world
    return PipelineStage(
        Blocks(net.layers[rank * per : (rank + 1) * per]), rank, world, torch.device("cpu")
    )


def interleaved_stages(net: Net, rank: int, world: int) -> list:
    """One stage per block, round robin over the ranks."""
    from torch.distributed.pipelining import PipelineStage

    n = len(net.layers)
    return [
        PipelineStage(Blocks(net.layers[s : s + 1]), s, n, torch.device("cpu"))
        for s in layers_of(net, rank, world, interleaved=True)
    ]
