-- the second database of docker-compose.yaml (the first, grpoflow_prefect, is POSTGRES_DB)
CREATE DATABASE grpoflow_mlflow;
