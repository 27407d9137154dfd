"""lm_eval's vLLM backend, for a reproducer that scores its documents' requests inline: a continuation " yes" is
likely (-0.1), any other unlikely (-2.0); under ``FAKE_LM_EVAL_FAULT=flip`` an fp8 cache swaps them where the
context names an odd document ("doc 3: ...")."""

import os
import re


class VLLM:
    def __init__(self, pretrained, **kwargs):
        from vllm import LLM  # the engine starts as lm_eval's backend starts it: the stand-in refuses what vLLM would

        LLM(model=pretrained, **kwargs)
        self.flip = os.environ.get("FAKE_LM_EVAL_FAULT") == "flip" and "fp8" in str(kwargs.get("kv_cache_dtype"))

    def loglikelihood(self, requests):
        out = []
        for r in requests:
            context, continuation = r.arguments
            yes = continuation.strip() == "yes"
            odd = int(re.match(r"doc (\d+)", context).group(1)) % 2 == 1
            if self.flip and odd:
                yes = not yes
            out.append((-0.1 if yes else -2.0, yes))
        return out
