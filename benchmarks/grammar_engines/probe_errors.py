"""Exception text for a few more malformed / unsupported schemas (llguidance and xgrammar).

    python probe_errors.py
"""

import engines

PROBES = [
    ("unknown format", {"type": "string", "format": "credit-card"}),
    ("missing $ref target", {"$ref": "#/$defs/nope"}),
    ("minItems > maxItems", {"type": "array", "minItems": 3, "maxItems": 1}),
    ("minimum > maximum", {"type": "integer", "minimum": 5, "maximum": 1}),
    ("bad regex pattern", {"type": "string", "pattern": "([a-z"}),
    ("lookahead pattern", {"type": "string", "pattern": "^(?=a)a+$"}),
    ("uniqueItems with lenient", {"type": "array", "uniqueItems": True}),
]


def main():
    for key in ["llg", "xgr"]:
        eng = engines.ENGINES[key]()
        print("=====", eng.name)
        for name, s in PROBES:
            opts = {"lenient": True} if "lenient" in name and key == "llg" else {}
            try:
                g = eng.compile(s, **opts)
                eng.matcher(g)
                print(f"  {name:26s} accepted")
            except Exception as e:  # noqa: BLE001 (the error's type and text are the figure)
                print(f"  {name:26s} {type(e).__name__}: {str(e).strip()[:220]!r}")


if __name__ == "__main__":
    main()
