"""The server job: HTTP front, inference engine, trainer of one trainable model."""
