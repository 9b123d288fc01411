"""What a step minimises, one module an objective, below the model and the step that use them (nothing here
imports either: an objective takes the model's outputs, or the model as a function, and the batch).

    language_model.py   next-token cross-entropy over packed documents: pretraining, and supervised
                        fine-tuning, whose conversations weight only the reply tokens (the batch's
                        `loss_mask`, made from each token's turn code by trainer/data/chat.py loss_mask)
    dpo.py              direct preference optimisation over packed pairs against frozen reference weights

The next objective (reinforcement learning's GRPO, say) is a module here beside these: its loss sums from
the model's log-probabilities and the batch's own fields, which trainer/training/step.py dispatches on
(data.format), as it does for DPO.
"""
