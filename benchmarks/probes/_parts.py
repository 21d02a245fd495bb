"""What the probes share: run each part, keep going past a failure, save after each."""
import traceback


def run_parts(parts, results: dict, save) -> None:
    """Call each part; a failure is recorded in ``results["errors"]`` and printed, and the
    next part still runs. ``save()`` writes the results after every part."""
    for part in parts:
        try:
            part()
        except Exception:
            results.setdefault("errors", []).append(traceback.format_exc()[-2000:])
            print(traceback.format_exc(), flush=True)
        save()
