"""Write the benchmark datasets (JSONL, one ``{"text": ...}`` per line) from the corpus below.

    python -m sokuji.bench.data.make_datasets

short.jsonl   ~12 tokens: search-style queries
long.jsonl    ~120 tokens: passages
mixed.jsonl   5 to 200 tokens, log-uniform: what an embedding endpoint behind RAG really sees

Token counts use the built-in MiniLM tokenizer (with [CLS] and [SEP]); the seed is fixed, so the
files are reproducible. The corpus was written for this project.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
SEED = 20261130

QUERIES = [
    "how do I reset the password on my home router",
    "best way to store fresh basil so it lasts longer",
    "what time does the central library close on sundays",
    "symptoms of vitamin d deficiency in adults over fifty",
    "convert a pandas dataframe column from string to datetime",
    "cheap flights from osaka to seoul in late march",
    "why does my sourdough starter smell like acetone",
    "difference between a roth ira and a traditional ira",
    "how long should I let a brisket rest after smoking",
    "error connection refused when starting postgres on ubuntu",
    "is it safe to run a dishwasher overnight while asleep",
    "which houseplants are safe for cats and dogs",
    "return policy for opened electronics bought online",
    "how to change the oil filter on a 2015 honda civic",
    "what does a high ferritin level in a blood test mean",
    "translate thank you very much into polite japanese",
    "kubernetes pod stuck in crashloopbackoff after deploy",
    "average salary of a data engineer in berlin in 2026",
    "can I get a refund if my train was delayed two hours",
    "how many grams of protein are in one boiled egg",
    "what is the capital gains tax rate on crypto sales",
    "recommend a quiet hotel near kyoto station under 150 dollars",
    "how to fix a leaking kitchen faucet without a plumber",
    "meaning of the error code e4 on a bosch washing machine",
    "when is the next solar eclipse visible from europe",
    "steps to appeal a parking ticket issued by mistake",
    "compare iphone battery life with the latest pixel phone",
    "does my travel insurance cover cancelled connecting flights",
    "best stretches for lower back pain after long drives",
    "how to merge two git branches without losing commits",
]

PASSAGES = [
    "The warranty covers manufacturing defects for twenty-four months from the date of "
    "purchase. It does not cover damage caused by accidents, misuse, unauthorised repairs or "
    "normal wear of consumable parts such as filters, seals and batteries.",
    "To request a refund, open the order in your account, choose the items you want to "
    "return and print the prepaid label. Refunds are issued to the original payment method "
    "within five business days after the parcel reaches our warehouse.",
    "Latency in a retrieval pipeline comes from many places: the network hop to the vector "
    "database, the embedding call, the re-ranking model and the final generation step. "
    "Measuring each stage separately is the only way to know which one to optimise first.",
    "The patient, a 67-year-old man with a history of hypertension and type 2 diabetes, "
    "presented with two days of worsening shortness of breath. Oxygen saturation was 89% on "
    "room air and a chest radiograph showed bilateral lower-lobe infiltrates.",
    "Quarterly revenue rose 12 percent year on year to 4.2 billion dollars, driven by strong "
    "demand for cloud services in Asia. Operating margin narrowed slightly because of higher "
    "data-centre depreciation and one-off restructuring costs in the European division.",
    "The city council approved a plan to convert three downtown parking garages into "
    "mixed-use buildings with affordable housing, shops and a public bicycle hub. "
    "Construction is expected to begin next spring and finish within four years.",
    "Kyoto's Fushimi Inari shrine is famous for its thousands of vermilion torii gates, which "
    "wind up the wooded slopes of Mount Inari. Visitors who arrive before seven in the "
    "morning can walk the lower trails in near silence.",
    "When the connection pool is exhausted, new requests wait for a free connection until "
    "the acquire timeout expires. Raising the pool size helps only if the database itself "
    "has spare capacity; otherwise queries simply queue inside the database instead.",
    "Store flour in an airtight container in a cool, dry place, away from strong odours. "
    "Whole-grain flours contain oils that turn rancid faster, so keep them in the "
    "refrigerator or freezer if you do not bake with them every week.",
    "The new firmware fixes a bug that caused the thermostat to lose its schedule after a "
    "power cut, improves Wi-Fi reconnection, and adds support for two additional languages. "
    "Updates install automatically overnight unless disabled in the settings menu.",
    "Under the agreement, the supplier must deliver the components within thirty days of "
    "each purchase order and replace any defective batch at its own cost. Either party may "
    "terminate the contract with ninety days' written notice.",
    "Transformers process all tokens of a sequence in parallel, but attention cost grows "
    "with the square of the sequence length. On a CPU, padding short sentences to the "
    "length of the longest one in a batch wastes much of the computation.",
    "Our support team is available Monday to Friday from nine to six, Central European Time. "
    "For urgent outages outside those hours, enterprise customers can call the on-call "
    "engineer through the number listed in their service agreement.",
    "The hiking trail climbs 900 metres over eleven kilometres and crosses two streams that "
    "can flood after heavy rain. Carry at least two litres of water, a map and a headlamp, "
    "and check the weather forecast before you set out.",
    "Die Bahn empfiehlt Reisenden, ihre Verbindung vor Fahrtantritt in der App zu prüfen, da "
    "es wegen Bauarbeiten zwischen Köln und Frankfurt zu Verspätungen und Zugausfällen "
    "kommen kann. Fahrgäste mit Zugbindung dürfen auf andere Züge ausweichen.",
    "東京から大阪までは新幹線でおよそ二時間半かかります。週末や連休は混雑するため、"
    "指定席を早めに予約することをおすすめします。",
]


def count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text).ids)


def cut_to(tok: Tokenizer, words: list[str], target: int) -> str:
    """The longest prefix of ``words`` whose token count does not exceed ``target``."""
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(tok, " ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def passage_words(rng: random.Random, target: int, tok: Tokenizer) -> list[str]:
    words: list[str] = []
    while count(tok, " ".join(words)) < target:
        words += rng.choice(PASSAGES).split()
    return words


def main() -> None:
    from sokuji.weights.minilm import tokenizer_path

    tok = Tokenizer.from_file(str(tokenizer_path()))
    tok.no_padding()  # the shipped tokenizer.json pads and truncates to 128
    tok.no_truncation()
    rng = random.Random(SEED)
    sets: dict[str, list[str]] = {"short": [], "long": [], "mixed": []}
    for _ in range(400):
        sets["short"].append(cut_to(tok, rng.choice(QUERIES).split(), 12))
        sets["long"].append(cut_to(tok, passage_words(rng, 120, tok), 120))
        target = round(math.exp(rng.uniform(math.log(5), math.log(200))))
        source = rng.choice(QUERIES).split() if target <= 12 else passage_words(rng, target, tok)
        sets["mixed"].append(cut_to(tok, source, target))
    for name, texts in sets.items():
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        lengths = sorted(count(tok, t) for t in texts)
        print(f"{name}: {len(texts)} texts, tokens min {lengths[0]} median "
              f"{lengths[len(lengths) // 2]} max {lengths[-1]}")


if __name__ == "__main__":
    main()
