"""The random models are well conditioned under transformers' Llama.

Greedy tokens are compared against transformers and across batch shapes, so
the top-1 logit must stand clear of the runner-up at every step, and hidden
states must stay O(1) through the layers.
"""

from __future__ import annotations

import pytest
import torch

from asyncpp.weights.random_loader import RANDOM_CONFIGS

NUM_PROMPTS = 8
NUM_NEW_TOKENS = 32
MIN_TOP_GAP = 1e-3


@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
def test_greedy_top1_gap_and_activation_scale(saved_random_model, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    arch, _, directory = saved_random_model[name]
    model = transformers.LlamaForCausalLM.from_pretrained(str(directory)).eval()
    generator = torch.Generator().manual_seed(1234)
    gaps: list[float] = []
    num_prompts = NUM_PROMPTS if arch.num_layers < 16 else NUM_PROMPTS // 2  # SmolLM2's 30 layers: ~10 s a half
    for prompt in range(num_prompts):
        ids = torch.randint(3, arch.vocab_size, (1, 3 + prompt), generator=generator)
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, use_cache=True)
            # hidden_states: embeddings, each layer but the last, final norm.
            for layer, hidden in enumerate(out.hidden_states[1:-1]):
                rms = hidden.pow(2).mean().sqrt().item()
                assert 0.5 < rms < 5.0, (name, prompt, layer, rms)
            logits, cache = out.logits[0, -1], out.past_key_values
            for _ in range(NUM_NEW_TOKENS):
                top2 = logits.topk(2).values
                gaps.append((top2[0] - top2[1]).item())
                step = model(logits.argmax().view(1, 1), past_key_values=cache, use_cache=True)
                logits, cache = step.logits[0, -1], step.past_key_values
    print(f"{name}: min top1-top2 gap {min(gaps):.4g} over {len(gaps)} steps")
    assert min(gaps) > MIN_TOP_GAP, (name, min(gaps))
