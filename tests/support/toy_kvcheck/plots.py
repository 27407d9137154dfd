from kvdiag.render.svg import bar_chart


def plots(cases, suffix=""):
    bars = [(c.kv_dtype, c.metrics.get("rounds"), None, None) for c in cases]
    return [bar_chart(f"toy rounds per kv dtype{suffix}", "rounds", bars)] if bars else []
