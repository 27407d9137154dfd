from kvdiag.checks.compare_rows import row


def rows(o, n, settings):
    a, b = o.metrics.get("rounds"), n.metrics.get("rounds")
    return [row(n, "toy rounds", a, b, "regression" if b > a else "ok")]
