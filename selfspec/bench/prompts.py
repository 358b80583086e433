"""Twenty varied prompts (chat, code, math, facts, lists) for acceptance measurements and lossless tests."""

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "If a train travels 60 miles per hour for 3 hours, how far does it go?",
    "Translate 'good morning' into Spanish and German.",
    "Write a haiku about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for pancakes.",
    "Who wrote Romeo and Juliet?",
    "Summarize the plot of Cinderella.",
    "What are the three states of matter?",
    "Write a SQL query that counts rows in a table named users.",
    "Why is the sky blue?",
    "Name five fruits that are red.",
    "Solve for x: 2x + 6 = 14.",
    "Describe a cat to someone who has never seen one.",
    "What does HTTP stand for?",
    "Write a short story opening about a lighthouse keeper.",
    "How do I reverse a string in JavaScript?",
]
