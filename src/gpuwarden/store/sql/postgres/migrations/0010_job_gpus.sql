-- Jobs on several GPUs (SPEC.md section 4, "gpus"): how many GPUs of one node a
-- job holds at once, when it says so itself (NULL: its type's count). An
-- attempt's GPUs are its gpu_uuid, comma-separated as CUDA_VISIBLE_DEVICES names
-- them.

ALTER TABLE jobs ADD COLUMN gpus INTEGER;
