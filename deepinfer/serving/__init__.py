"""The serving surface: API-shaped requests, deepseek-recipe glue, structured output, the tool-call grammar."""
