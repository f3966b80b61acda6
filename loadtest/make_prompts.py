"""Regenerate prompts.jsonl: ~200 prompts of mixed lengths, composed from text written for Tandem (CC0)."""
from __future__ import annotations

import json
import random
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
    "What does a compiler do?", "Name three primary colours.", "What is 17 times 23?",
    "Who wrote the play Hamlet?", "What is photosynthesis?", "How far is the Moon from Earth?",
    "What is the boiling point of water at sea level?", "Explain what a prime number is.",
    "What is the difference between weather and climate?", "Why do cats purr?",
    "What is a black hole?", "How does a bicycle stay upright?", "What is the largest ocean?",
    "What is a haiku?", "Translate 'good morning' into Spanish.", "What is the speed of light?",
    "How do vaccines work?", "What is machine learning?", "Give me a synonym for 'happy'.",
    "What is the square root of 144?", "Why do leaves change colour in autumn?",
    "What is an API?", "How many continents are there?", "What causes tides?",
    "What is the chemical symbol for gold?", "What is inflation in economics?",
    "Who painted the Mona Lisa?", "How does a refrigerator keep food cold?",
    "What is a linked list?", "Why is exercise good for the heart?", "What is a volcano?",
    "What language is spoken in Brazil?", "What is the freezing point of water in Fahrenheit?",
    "How do bees make honey?", "What is recursion?", "Why do we have seasons?",
    "What is the Pythagorean theorem?",
]
TASKS = [
    "Write a short poem about {t}.", "Summarise the main ideas of {t} in three bullet points.",
    "Explain {t} to a ten-year-old.", "Write a product description for a gadget related to {t}.",
    "List five surprising facts about {t}.", "Write a friendly email inviting a colleague to a talk on {t}.",
    "Give a step-by-step plan for learning about {t} in one month.",
    "Write the opening paragraph of a mystery story that involves {t}.",
    "Argue for and against spending more public money on {t}.", "Write a limerick about {t}.",
]
TOPICS = [
    "tide pools", "the history of the printing press", "sourdough baking", "electric cars", "honeybees",
    "the water cycle", "chess openings", "deep sea fish", "solar panels", "ancient Rome", "jazz music",
    "mountain weather", "graph algorithms", "urban gardening", "the human immune system", "lighthouses",
    "volcanic islands", "paper airplanes", "the Silk Road", "GPU computing",
]
SENTENCES = [
    "The harbour town woke early, and the fishing boats left before the sun had cleared the hills.",
    "Engineers measured the bridge every spring, noting how the steel stretched in the summer heat.",
    "A small library on the corner kept its doors open late so that students could study in the warmth.",
    "The recipe called for flour, water and salt, but the baker insisted that patience mattered most.",
    "During the storm the power failed, and the neighbours gathered around a single candle to tell stories.",
    "The committee debated the budget for hours before agreeing to fund the new bus routes.",
    "Scientists placed sensors along the river to track how quickly the snowmelt arrived each year.",
    "The old map showed roads that no longer existed and a forest where a city now stands.",
    "Every server in the data centre reported its temperature once a second to a central dashboard.",
    "The orchestra rehearsed the final movement again, slowing the tempo until the strings sounded clear.",
    "Farmers rotated their crops to keep the soil healthy and to break the cycles of pests.",
    "The museum's newest exhibit explained how clocks were made before electricity was common.",
    "A volunteer crew repaired the trail after the landslide, moving stones by hand for three weeks.",
    "The software team found that most of the delay came from waiting on a single slow database query.",
    "Children at the school planted a garden and recorded how tall the sunflowers grew each week.",
    "The train crossed the plateau at night, and passengers watched the stars through the wide windows.",
    "Doctors at the clinic reviewed the results together before explaining the treatment plan.",
    "The company switched to renewable energy and published its monthly consumption for anyone to read.",
    "Historians disagree about why the ancient city was abandoned, but drought is the leading theory.",
    "The cat ignored the expensive toy and spent the afternoon playing with the cardboard box it came in.",
    "Rain had filled the reservoir by March, so the town lifted its restrictions on watering gardens.",
    "The chess club met on Thursdays, and the youngest member had already won the regional tournament.",
    "A new compiler release made the program twenty percent faster without changing a line of its code.",
    "The lighthouse keeper wrote in a logbook each evening, describing the ships and the state of the sea.",
]
LONG_ASKS = [
    "Summarise the text above in two sentences.", "List the people and places mentioned above.",
    "What is the overall mood of the passage above? Explain briefly.",
    "Write three questions a reader might ask after reading the text above.",
    "Rewrite the first paragraph above in plain, simple English.",
]


def passage(rng: random.Random, n_sentences: int) -> str:
    sentences = [rng.choice(SENTENCES) for _ in range(n_sentences)]
    paragraphs = [" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)]
    return "\n\n".join(paragraphs)


def build(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = [{"kind": "short", "prompt": q} for q in QUESTIONS]
    for _ in range(80):
        rows.append({"kind": "medium", "prompt": rng.choice(TASKS).format(t=rng.choice(TOPICS))})
    for i in range(80):
        n = rng.choice([6, 10, 15, 25]) if i % 4 else 36  # a tail of long contexts (~600 words, ~800 tokens)
        rows.append({"kind": "long", "prompt": passage(rng, n) + "\n\n" + rng.choice(LONG_ASKS)})
    rng.shuffle(rows)
    return [{"id": i, **row} for i, row in enumerate(rows)]


def main() -> None:
    path = Path(__file__).with_name("prompts.jsonl")
    with path.open("w") as f:
        for row in build():
            f.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
