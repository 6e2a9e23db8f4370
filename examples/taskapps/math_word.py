"""Grade-school math word problems with integer answers: 50 hand-written problems, exact-answer reward.

The reward is 1 when the last integer in the reply (thousands separators allowed, e.g. `1,200`) equals the
answer, else 0. Every fifth problem is in the `test` split (10), the rest in `train` (40). The split comes
from `env.config.split`, else from the mode (`rl` plays `train`, `eval` plays `test`); the seed picks the
problem within the split: `split[seed % len(split)]`.

    python -m tandem_taskapp.serve examples/taskapps/math_word.py --port 8003"""

from __future__ import annotations

import re
from typing import Any

from tandem_taskapp import InvalidArgument, Policy, Result, RolloutRequest, TaskApp

PROBLEMS: tuple[tuple[str, int], ...] = (
    ("Sam has 12 apples and buys 7 more. How many apples does Sam have now?", 19),
    ("A box holds 6 eggs. How many eggs are in 9 boxes?", 54),
    ("Mia had 45 stickers and gave 18 to her brother. How many stickers does she have left?", 27),
    ("There are 32 students split equally into 4 teams. How many students are on each team?", 8),
    ("A pencil costs 3 dollars. How many dollars do 14 pencils cost?", 42),
    ("Tom reads 15 pages a day. How many pages does he read in one week?", 105),
    ("A farmer has 8 cows and 5 times as many chickens. How many chickens does he have?", 40),
    ("A bus has 48 seats and 29 of them are taken. How many seats are empty?", 19),
    ("Lena saves 25 dollars every month. How many dollars does she save in 12 months?", 300),
    ("A rope 84 meters long is cut into pieces 7 meters long. How many pieces are there?", 12),
    (
        "There are 3 shelves with 17 books each and 1 shelf with 9 books. How many books are there in total?",
        60,
    ),
    ("A baker made 120 cookies and sold 87. How many cookies are left?", 33),
    ("Each bike has 2 wheels. How many wheels do 23 bikes have?", 46),
    ("Jake is 11 years old. His father is 3 times as old. How old is his father?", 33),
    ("A class has 14 girls and 16 boys. Each student gets 2 pencils. How many pencils are handed out?", 60),
    ("A garden has 6 rows of 8 tomato plants, and 5 plants died. How many plants are still alive?", 43),
    (
        "Anna had 50 dollars. She bought a book for 12 dollars and a bag for 23 dollars. How many dollars are left?",
        15,
    ),
    ("A train travels 60 kilometers per hour. How many kilometers does it travel in 5 hours?", 300),
    ("96 marbles are shared equally among 8 children. How many marbles does each child get?", 12),
    ("A pack has 24 cans. How many cans are in 5 packs?", 120),
    ("Ben ran 3 kilometers on Monday, 5 on Tuesday and 4 on Wednesday. How many kilometers did he run?", 12),
    ("A pizza is cut into 8 slices. How many slices are there in 7 pizzas?", 56),
    ("The temperature was 4 degrees and then dropped by 9 degrees. What is the temperature now?", -5),
    ("A store had 200 shirts. It sold 65 on Friday and 78 on Saturday. How many shirts are left?", 57),
    ("Each ticket costs 9 dollars. How many dollars do 13 tickets cost?", 117),
    (
        "An empty tank holds 500 liters and is filled at 25 liters per minute. How many minutes does filling take?",
        20,
    ),
    ("Kim has 3 times as many pens as Leo, and Leo has 7 pens. How many pens do they have together?", 28),
    ("A square has sides of 9 centimeters. What is its perimeter in centimeters?", 36),
    ("A rectangle is 12 meters long and 5 meters wide. What is its area in square meters?", 60),
    ("A movie starts at 2 o'clock and lasts 150 minutes. How many minutes past 4 o'clock does it end?", 30),
    ("There are 7 days in a week. How many days are there in 15 weeks?", 105),
    ("Sara picks 18 flowers and puts 3 in each vase. How many vases does she fill?", 6),
    ("A school orders 36 boxes of chalk with 12 sticks in each box. How many sticks is that?", 432),
    ("Max had 64 cards and lost a quarter of them. How many cards does he have now?", 48),
    (
        "Juice costs 4 dollars a bottle. Ella buys 8 bottles and pays with 50 dollars. How much change does she get?",
        18,
    ),
    ("A spider has 8 legs. How many legs do 12 spiders have?", 96),
    ("Half of the 90 people at a party are adults and the rest are children. How many are children?", 45),
    (
        "A book has 240 pages. Nora has read 3 chapters of 40 pages each. How many pages are left to read?",
        120,
    ),
    ("Every car in a parking lot has 4 wheels, and there are 100 wheels. How many cars are there?", 25),
    ("Liam scored 17, 23 and 20 points in three games. What is his total score?", 60),
    ("A farmer plants 15 rows of corn with 20 plants in each row. How many plants is that?", 300),
    ("A jar has 75 candies that 5 friends share equally. How many candies does each friend get?", 15),
    ("A plane has 180 seats in rows of 6. How many rows are there?", 30),
    ("Olivia is 8 years older than her brother, who is 9. How old will Olivia be in 5 years?", 22),
    ("A bag of rice weighs 2 kilograms. How many kilograms do 35 bags weigh?", 70),
    ("Noah had 30 dollars, earned 45 more, then spent 28. How many dollars does he have now?", 47),
    ("A bell rings once every hour. How many times does it ring in 3 days?", 72),
    ("A team won 18 games and lost 7, with no draws. How many games did they play?", 25),
    ("There are 1000 grams in a kilogram. How many grams are in 6 kilograms?", 6000),
    ("A printer prints 35 pages a minute. How many pages does it print in 8 minutes?", 280),
)

SPLITS: dict[str, tuple[int, ...]] = {
    "train": tuple(i for i in range(len(PROBLEMS)) if i % 5 != 4),
    "test": tuple(i for i in range(len(PROBLEMS)) if i % 5 == 4),
}

SYSTEM = "Solve the math problem. Think step by step if you like, and end your reply with the final number."
_INT = re.compile(r"-?\d+(?:,\d{3})*(?!\d)")


def last_integer(text: str) -> int | None:
    """The last integer in `text` (`1,200` reads as 1200, `-5` as -5), or None."""
    found = _INT.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def split_for(config: dict[str, Any], mode: str) -> str:
    split = config.get("split", "test" if mode == "eval" else "train")
    if split not in SPLITS:
        raise InvalidArgument(f"env.config.split must be one of {sorted(SPLITS)}")
    return str(split)


def problem_index(seed: int, split: str) -> int:
    ids = SPLITS[split]
    return ids[seed % len(ids)]


def task_info(seed: int) -> dict[str, Any]:
    picks = {}
    for split in SPLITS:
        i = problem_index(seed, split)
        picks[split] = {"problem_id": i, "question": PROBLEMS[i][0]}
    return {"instance": picks}


async def rollout(seed: int, policy: Policy, config: dict[str, Any], request: RolloutRequest) -> Result:
    split = split_for(config, request.mode)
    i = problem_index(seed, split)
    question, answer = PROBLEMS[i]
    reply = await policy.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    parsed = last_integer(reply)
    return Result(
        outcome_reward=1.0 if parsed == answer else 0.0,
        details={"split": split, "problem_id": i, "expected": answer, "parsed": parsed},
    )


app = TaskApp(
    name="math-word",
    description=__doc__ or "",
    task_info=task_info,
    rollout=rollout,
    splits=[
        {"name": "train", "size": len(SPLITS["train"]), "description": "problems whose index % 5 != 4"},
        {"name": "test", "size": len(SPLITS["test"]), "description": "problems whose index % 5 == 4"},
    ],
    default_split="train",
    rubric={
        "outcome": {
            "description": "1 if the last integer in the reply equals the answer, else 0",
            "min": 0.0,
            "max": 1.0,
        }
    },
    max_turns=1,
    max_seconds=120,
)
