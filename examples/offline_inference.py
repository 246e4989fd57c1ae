"""Offline inference with the Python API.

    python examples/offline_inference.py [MODEL_DIR]

Without MODEL_DIR (and without DEEPINFER_HF_MODEL_DIR) it runs the embedded tiny model, whose random weights
produce meaningless text.
"""

import sys

from deepinfer import LLM, SamplingParams


def main() -> None:
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=48, seed=0)
    chats = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    ]
    for out in llm.chat(chats, params):
        print(f"--- reply {out.index} ({out.num_generated_tokens} tokens, {out.finish_reason})")
        print(out.text)
    raw = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_new_tokens=16))[0]
    print(f"--- raw completion: {raw.text!r}")


if __name__ == "__main__":
    main()
