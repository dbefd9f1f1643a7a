"""The evaluation stage: policies scored on held-out prompts (`evaluate`) and length control (`length_control`)."""
