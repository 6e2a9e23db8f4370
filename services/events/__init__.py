"""Event stream: durable, ordered, resumable job events and metric series."""
