"""Real prompts for the end-to-end latency benchmarks: documents written for this project with a question after
them, turned into token-id prompts of an exact length with the served model's tokenizer.

Used by ``benchmarks.first_token`` (and meant for every benchmark of user-facing latency) when it runs on a
real model (SmolLM2-135M-Instruct, ``pd_disagg.smollm2``); the random-weight test models get random token ids
instead, which their tokenizers cannot tell apart from text. Each prompt starts with its own request number and
takes the documents in its own order, so no two prompts share a prefix-cache block.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple


class ModelLimits(NamedTuple):
    """What random token-id prompts for a served model must respect (its Hugging Face ``config.json``), for
    the benchmarks that size prompts by the context as well as draw ids from the vocabulary."""

    vocab: int  # token ids below this
    max_len: int  # positions: prompt plus output tokens


def model_limits(model: Path) -> ModelLimits:
    """The vocabulary size and context length of the model in directory ``model``."""
    config = json.loads((model / "config.json").read_text())
    return ModelLimits(int(config["vocab_size"]), int(config["max_position_embeddings"]))


#: Documents a user pastes before a question: the long prompts (routed P->D). Topics are ordinary on purpose.
DOCUMENTS = (
    "The town library opened its new reading room in the spring. The room has tall windows facing the river, "
    "twelve long tables, and shelves for the local history collection, which used to be stored in the basement. "
    "Volunteers spent three weekends moving the boxes, cleaning old maps, and labelling photographs of the market "
    "square as it looked a hundred years ago. The librarian says that visits have doubled since the opening, and "
    "that school classes now come every Thursday morning to read letters written by the town's first settlers.",
    "A good loaf of bread needs only flour, water, salt and yeast, but the method matters as much as the "
    "ingredients. Mix the flour and water first and let them rest for half an hour, so the flour absorbs the "
    "water. Add the salt and the yeast, knead until the dough is smooth, and let it rise in a warm place until it "
    "has doubled in size. Shape it gently, let it rise again, and bake it in a very hot oven with a tray of water "
    "on the lowest shelf, which keeps the crust thin and crisp.",
    "The committee met on Tuesday to discuss the budget for the coming year. The treasurer reported that income "
    "from membership fees rose by eight percent, while the cost of renting the hall went up by twelve percent. "
    "Members agreed to postpone the purchase of a new projector and to ask the council for a grant towards the "
    "repair of the roof. The next meeting will review quotes from three builders and decide whether the summer "
    "festival should move from the hall to the park, where there is more space and no rent to pay.",
    "Migrating birds travel thousands of kilometres each year between their breeding grounds and the places "
    "where they spend the winter. Many of them fly at night, when the air is calmer and cooler, and rest and feed "
    "during the day. Scientists believe that birds find their way using the position of the sun and the stars, "
    "the earth's magnetic field, and landmarks such as coastlines and mountain ranges. Young birds often make "
    "their first journey without their parents, which suggests that much of this ability is inborn.",
    "Our support team answers questions by email and chat from eight in the morning until six in the evening. "
    "Before you contact us, please check that your device is charged, that it runs the latest version of the "
    "app, and that you are signed in with the same account you used to buy your subscription. If the problem "
    "continues, write down the exact message on the screen and the time it appeared. This helps us find the "
    "cause quickly and saves you from answering the same questions twice.",
    "The hiking trail starts at the car park behind the visitor centre and climbs through a pine forest to a "
    "ridge with views over the valley. The first section is steep but well marked, with wooden steps on the "
    "hardest parts. After about an hour the path levels out and follows the ridge to a small lake, where most "
    "walkers stop for lunch. The return route goes down the other side of the valley and crosses the river on "
    "an old stone bridge. Allow four hours in total and bring water, since there are no shops along the way.",
    "Learning a new language as an adult takes patience, but a few habits make it easier. Study a little every "
    "day rather than a lot once a week, because memory works best with regular repetition. Listen to the "
    "language as often as you can, even when you do not understand every word, and try to speak from the first "
    "week, even if only to yourself. Keep a notebook of useful phrases instead of single words, and review it "
    "before you sleep. Above all, do not be afraid of mistakes: they are how everyone learns.",
    "The museum's new exhibition tells the story of the railway that once connected the mining villages in the "
    "hills with the port on the coast. Visitors can climb into a restored carriage, listen to recordings of "
    "former drivers and station masters, and see the tickets, timetables and uniforms they used. A large model "
    "shows the line as it was in its busiest years, with trains carrying coal down to the ships and passengers "
    "up to the villages on market days. The exhibition is open until the end of the year.",
)

QUESTION = "\n\nSummarise the text above in three sentences."


class RealPrompts:
    """Token-id prompts of real text, of any length the model allows, for one model's tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._count = 0

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def document(self, tokens: int, rng: random.Random) -> list[int]:
        """A document prompt of exactly ``tokens`` tokens: request number, documents in a fresh order (as many
        as it takes), the question at the end."""
        self._count += 1
        head = self.encode(f"Request {self._count}.\n\n")
        tail = self.encode(QUESTION)
        body: list[int] = []
        while len(body) < tokens - len(head) - len(tail):
            body += self.encode("\n\n".join(rng.sample(DOCUMENTS, len(DOCUMENTS))) + "\n\n")
        return (head + body[: max(0, tokens - len(head) - len(tail))] + tail)[:tokens]
