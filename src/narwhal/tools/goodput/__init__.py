"""`narwhal goodput`: replay a load trace over every static prefill/decode split."""
