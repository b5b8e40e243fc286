"""The demo corpus's code skill: six classic algorithms in Python (the answers, runnable and tested
by ``eval_demo``), the many ways a user asks for them, and the conversation maker that
:mod:`dynamoe.examples.demo_data` mixes into the corpus."""
from __future__ import annotations

import random

__all__ = ["ALGORITHMS", "CODE_FUNCTIONS", "CODE", "CANONICAL_CODE_PROMPTS", "code_prompts", "code_reply", "make_code"]

ALGORITHMS = ("quicksort", "binary_search", "fibonacci", "factorial", "bubble_sort", "gcd")
CODE_FUNCTIONS = {"quicksort": "quicksort", "binary_search": "binary_search", "fibonacci": "fibonacci",
                  "factorial": "factorial", "bubble_sort": "bubble_sort", "gcd": "gcd"}
CODE = {
    "quicksort": '''def quicksort(arr):
    if len(arr) <= 1:
        return arr
    pivot = arr[len(arr) // 2]
    left = [x for x in arr if x < pivot]
    middle = [x for x in arr if x == pivot]
    right = [x for x in arr if x > pivot]
    return quicksort(left) + middle + quicksort(right)


print(quicksort([3, 6, 8, 10, 1, 2, 1]))
''',
    "binary_search": '''def binary_search(arr, target):
    low, high = 0, len(arr) - 1
    while low <= high:
        mid = (low + high) // 2
        if arr[mid] == target:
            return mid
        if arr[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1


print(binary_search([1, 3, 5, 7, 9, 11], 7))
''',
    "fibonacci": '''def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


print([fibonacci(i) for i in range(10)])
''',
    "factorial": '''def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result


print(factorial(5))
''',
    "bubble_sort": '''def bubble_sort(arr):
    arr = list(arr)
    n = len(arr)
    for i in range(n):
        swapped = False
        for j in range(n - 1 - i):
            if arr[j] > arr[j + 1]:
                arr[j], arr[j + 1] = arr[j + 1], arr[j]
                swapped = True
        if not swapped:
            break
    return arr


print(bubble_sort([5, 1, 4, 2, 8]))
''',
    "gcd": '''def gcd(a, b):
    while b:
        a, b = b, a % b
    return abs(a)


print(gcd(48, 18))
''',
}
_CODE_INTRO = {
    "quicksort": "Here is quicksort in Python. It picks a pivot, splits the list into smaller, equal and larger "
                 "elements, and sorts the two sides recursively:",
    "binary_search": "Here is binary search in Python. It halves the search range of a sorted list until it finds "
                     "the target, and returns its index (or -1 if it is missing):",
    "fibonacci": "Here is a Python function for the Fibonacci numbers. It returns the n-th number, with "
                 "fibonacci(0) = 0 and fibonacci(1) = 1:",
    "factorial": "Here is the factorial function in Python. It multiplies the numbers from 2 to n "
                 "(and factorial(0) = 1):",
    "bubble_sort": "Here is bubble sort in Python. It swaps neighbouring elements that are out of order until a "
                   "pass makes no swap:",
    "gcd": "Here is the greatest common divisor in Python, with Euclid's algorithm:",
}
_CODE_NAMES = {
    "quicksort": ["quicksort", "Quicksort", "quick sort", "Quick Sort", "QuickSort"],
    "binary_search": ["binary search", "Binary Search", "binary_search", "Binary search"],
    "fibonacci": ["fibonacci", "Fibonacci", "Fibonacci numbers", "the Fibonacci sequence"],
    "factorial": ["factorial", "Factorial", "the factorial function", "factorials"],
    "bubble_sort": ["bubble sort", "Bubble Sort", "bubblesort", "Bubble sort"],
    "gcd": ["gcd", "GCD", "greatest common divisor", "Euclid's algorithm", "the Euclidean algorithm"],
}
_CODE_TEMPLATES = [
    "Write a Python code of the {n} algorithm.", "Write a Python function for {n}.", "Implement {n} in Python.",
    "Can you show me {n} in Python?", "Give me Python code for {n}.", "How do I implement {n} in Python?",
    "Show me a Python implementation of {n}.", "Write {n} in Python.", "Python code for {n}, please.",
    "write a python function that implements {n}", "I need {n} in Python.", "Code {n} in Python.",
    "Could you write {n} in Python for me?", "Write a Python program for {n}.", "Python implementation of {n}?",
]
#: the wordings the issue asks for by name: always in training, and always evaluated
CANONICAL_CODE_PROMPTS = {
    "quicksort": "Write a Python code of the Quicksort algorithm.",
    "binary_search": "Write a Python code of the Binary Search algorithm.",
    "fibonacci": "Write a Python function for Fibonacci.",
    "factorial": "Write a Python function for factorial.",
    "bubble_sort": "Write a Python code of the Bubble Sort algorithm.",
    "gcd": "Write a Python function for gcd.",
}


def code_prompts(algo: str) -> list[str]:
    """Every wording of a request for ``algo`` (templates x names)."""
    out = [CANONICAL_CODE_PROMPTS[algo]]
    for t in _CODE_TEMPLATES:
        for n in _CODE_NAMES[algo]:
            p = t.format(n=n)
            if p not in out:
                out.append(p)
    return out


def code_reply(algo: str) -> str:
    return f"{_CODE_INTRO[algo]}\n\n```python\n{CODE[algo]}```"


def make_code(rng: random.Random):
    algo = rng.choice(ALGORITHMS)
    prompt = rng.choice(code_prompts(algo))
    return f"code:{prompt}", f"code-{algo}", prompt, code_reply(algo), algo
