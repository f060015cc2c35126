"""TensorRT-LLM KV events → llmserve's block hashes, on the documented event dicts.

TensorRT-LLM cannot be installed here, so these dicts are written as its KVCacheEventSerializer
writes them (trtllm_kv_events.py's docstring); what is checked is that the translation makes the
hashes preprocess computes for the same prompt, so the routing index matches them.
"""

from __future__ import annotations

from llmserve.block_hash import HashNamespace
from llmserve.inference.engine.trtllm_kv_events import TrtllmKvEventTranslator

BLOCK = 4
NAMESPACE = HashNamespace(model_fingerprint=11, tokenizer_fingerprint=22, block_size_tokens=BLOCK)
PROMPT = list(range(100, 113))  # 3 full blocks and one token


def stored(parent, blocks, extra_id=0):
    """A "stored" event of (TensorRT-LLM hash, tokens) blocks, the way its serializer writes it."""
    return {
        "event_id": 1,
        "window_size": 4096,
        "data": {
            "type": "stored",
            "parent_hash": parent,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": trt_hash,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra_id} for t in tokens],
                    "cache_level": 0,
                    "priority": 35,
                }
                for trt_hash, tokens in blocks
            ],
        },
    }


def removed(*trt_hashes):
    return {"event_id": 2, "window_size": 4096, "data": {"type": "removed", "block_hashes": list(trt_hashes)}}


def test_stored_blocks_get_the_hashes_preprocess_computes():
    ours = NAMESPACE.block_hashes(PROMPT)
    translator = TrtllmKvEventTranslator(NAMESPACE)
    # Two events: the first two blocks, then the third chained to the second by TensorRT-LLM's hash.
    events = translator.translate([
        stored(None, [(901, PROMPT[0:4]), (902, PROMPT[4:8])]),
        stored(902, [(903, PROMPT[8:12])]),
    ])
    assert events == [(None, ours[:2]), (ours[1], [ours[2]])]


def test_removed_blocks_are_named_by_our_hash_and_forgotten():
    ours = NAMESPACE.block_hashes(PROMPT)
    translator = TrtllmKvEventTranslator(NAMESPACE)
    translator.translate([stored(None, [(901, PROMPT[0:4]), (902, PROMPT[4:8])])])
    assert translator.translate([removed(902, 777)]) == [ours[1]]  # 777: never stored, nothing to say
    assert translator.translate([removed(902)]) == []
    # A block whose parent was removed and is stored again later chains from the stored parent.
    assert translator.translate([stored(901, [(905, PROMPT[4:8])])]) == [(ours[0], [ours[1]])]


def test_what_cannot_be_chained_is_skipped():
    ours = NAMESPACE.block_hashes(PROMPT)
    translator = TrtllmKvEventTranslator(NAMESPACE)
    # A partial block ends the chain; what came before it is kept.
    assert translator.translate([stored(None, [(901, PROMPT[0:4]), (909, PROMPT[4:6])])]) == [(None, ours[:1])]
    # A parent stored before the translator started (unknown): nothing can be hashed.
    assert translator.translate([stored(12345, [(903, PROMPT[8:12])])]) == []
    # Extra token ids (LoRA, multimodal): content our hash does not see.
    assert TrtllmKvEventTranslator(NAMESPACE).translate([stored(None, [(901, PROMPT[0:4])], extra_id=7)]) == []


def test_created_and_updated_events_say_nothing_routing_needs():
    translator = TrtllmKvEventTranslator(NAMESPACE)
    created = {"event_id": 0, "window_size": 4096, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}}
    updated = {
        "event_id": 3, "window_size": 4096,
        "data": {"type": "updated", "block_hash": 901, "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}},
    }
    assert translator.translate([created, updated]) == []
