"""Prefix reuse on the real target: saved llama.cpp states restore exactly, output does not
depend on what was cached (up to DESIGN.md's near-tie rule), cached_tokens is exact."""

from __future__ import annotations

import pytest

from homespec.llama import prefix_store
from homespec.llama.prefix_cache import PrefixCache
from homespec.llama.template import ChatTemplate
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.tokens import common_prefix
from tests.integration.exactness import Recording, first_divergence, margin

SYSTEM_A = "You are a terse assistant for a home automation server. " * 12
SYSTEM_B = "You are a cheerful poet who answers in rhyme about gardens. " * 12
MAX_TOKENS = 24


def chat_tokens(rt, system, turns):
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return rt.tokenize(ChatTemplate(rt.chat_template).render(msgs), add_special=False)


def run(engine, cache, prompt):
    if cache is not None:
        cache.prepare(engine.target, prompt)
    else:
        engine.target.reset()
    st = GenerationStats()
    text = "".join(ev.text for ev in engine.generate(prompt, max_tokens=MAX_TOKENS, policy=FixedPolicy(), stats=st))
    return text, st


def assert_same_or_near_tie(target_rt, prompt, warm_text, epsilon):
    """Warm output must equal a cold run, or diverge only where the cold run had a near-tie."""
    rec = Recording(target_rt)
    eng = Engine(rec)
    target_rt.reset()
    cold = [t for ev in eng.generate(prompt, max_tokens=MAX_TOKENS) for t in ev.tokens]
    warm = target_rt.tokenize(warm_text, add_special=False, parse_special=False)
    if target_rt.detokenize(cold) == warm_text:
        return
    j = first_divergence(cold, warm)
    rows = dict(rec.rows)
    # (j == 0 is the first answer token, whose logits come from the prompt's last row)
    m = margin(rows[len(prompt) + j - 1]) if j is not None and len(prompt) + j - 1 in rows else None
    # 2 epsilon: noise on both top logits can flip a margin up to twice the noise of one logit.
    assert m is not None and m < 2 * epsilon, f"warm output diverged at token {j}, cold margin {m} >= 2 epsilon ({2 * epsilon})"


@pytest.mark.integration
def test_second_turn_reuses_history_and_reports_exact_cached_tokens(target_rt, epsilon):
    eng, cache = Engine(target_rt), PrefixCache(64 << 20)
    turn1 = chat_tokens(target_rt, SYSTEM_A, ["What is MQTT?"])
    text1, st1 = run(eng, cache, turn1)
    live = list(target_rt.tokens)  # exactly what the KV cache holds now
    turn2 = chat_tokens(target_rt, SYSTEM_A, ["What is MQTT?", text1, "And Zigbee?"])
    shared = next((i for i, (a, b) in enumerate(zip(live, turn2)) if a != b), min(len(live), len(turn2)))
    text2, st2 = run(eng, cache, turn2)
    assert st2.cached_tokens == shared > len(turn1) // 2
    assert_same_or_near_tie(target_rt, turn2, text2, epsilon)


@pytest.mark.integration
def test_a_different_system_prompt_misses_and_the_answer_is_still_correct(target_rt, epsilon):
    eng, cache = Engine(target_rt), PrefixCache(64 << 20)
    prompt_a = chat_tokens(target_rt, SYSTEM_A, ["Name a sensor."])
    run(eng, cache, prompt_a)
    prompt_b = chat_tokens(target_rt, SYSTEM_B, ["Name a flower."])
    text, st = run(eng, cache, prompt_b)
    # Only the template's opening ("<|im_start|>system\nYou are a") is shared.
    assert st.cached_tokens == common_prefix(prompt_a, prompt_b) < 10
    assert_same_or_near_tie(target_rt, prompt_b, text, epsilon)


@pytest.mark.integration
def test_restored_saved_state_continues_exactly_like_the_live_cache(target_rt, epsilon):
    target_rt.reset()  # no history from earlier tests: the cache must start empty-handed
    eng, cache = Engine(target_rt), PrefixCache(256 << 20, min_tokens=64)
    prompt_a = chat_tokens(target_rt, SYSTEM_A, ["List two smart plugs."])
    run(eng, cache, prompt_a)
    run(eng, cache, chat_tokens(target_rt, SYSTEM_B, ["A rhyme about tulips."]))  # A is saved
    assert len(cache) == 1
    text, st = run(eng, cache, prompt_a)  # A restored from its saved state
    assert cache.restores == 1 and st.cached_tokens == len(prompt_a) - 1
    assert_same_or_near_tie(target_rt, prompt_a, text, epsilon)


@pytest.mark.integration
def test_a_state_saved_to_disk_restores_in_a_new_cache_and_continues_like_the_live_one(target_rt, epsilon, tmp_path):
    """A restart: the histories written at stop are read into a fresh prefix cache and one is
    loaded into llama.cpp (prefix_store.py)."""
    target_rt.reset()
    eng, cache = Engine(target_rt), PrefixCache(256 << 20, min_tokens=64)
    prompt_a = chat_tokens(target_rt, SYSTEM_A, ["Name two door sensors."])
    run(eng, cache, prompt_a)
    run(eng, cache, chat_tokens(target_rt, SYSTEM_B, ["A rhyme about roses."]))  # A is saved
    key = prefix_store.fingerprint(target_rt.state_identity())
    assert prefix_store.save(tmp_path, key, cache.saved()) == 1
    restarted = PrefixCache(256 << 20, min_tokens=64)
    for h in prefix_store.read(tmp_path, key):
        assert restarted.adopt(h.tokens, h.size, h.fill)
    target_rt.reset()
    text, st = run(eng, restarted, prompt_a)
    assert restarted.restores == 1 and st.cached_tokens == len(prompt_a) - 1
    assert_same_or_near_tie(target_rt, prompt_a, text, epsilon)


@pytest.mark.integration
def test_cached_prefix_longer_than_the_new_prompt_is_truncated(target_rt, epsilon):
    eng, cache = Engine(target_rt), PrefixCache(0)
    long_prompt = chat_tokens(target_rt, SYSTEM_A, ["Explain Wi-Fi channels in detail."])
    run(eng, cache, long_prompt)
    short = long_prompt[: len(long_prompt) - 12]  # strictly inside what is cached
    text, st = run(eng, cache, short)
    assert st.cached_tokens == len(short) - 1
    assert_same_or_near_tie(target_rt, short, text, epsilon)
