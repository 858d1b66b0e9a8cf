"""What one training loop trains: a task supplies the model, the batch and the loss."""
