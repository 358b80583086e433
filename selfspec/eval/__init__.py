"""Quality evaluation of modes and recipes: GSM8K, HumanEval, MATH-500 and perplexity (`selfspec eval`)."""
